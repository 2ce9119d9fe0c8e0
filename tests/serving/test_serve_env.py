"""``app.cli.serve_env``: what ``loraplex serve`` sets so stacks on one machine share nothing."""

from __future__ import annotations

import shutil

from app.cli.serve_env import haproxy_bufsize, serve_env
from app.cli.serve_config_check import largest_header_bytes

PORTS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
LIMIT = 64 * 2**10


def test_two_haproxy_stacks_get_their_own_files_and_ports():
    """Serve's fixed fallback proxy port (8500) would let a starting stack's HAProxy answer with
    another stack's application (seen: a second stack's readiness probe answered by the first)."""
    a, dir_a = serve_env({}, "haproxy", LIMIT)
    b, dir_b = serve_env({}, "haproxy", LIMIT)
    try:
        assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        for env, run_dir in ((a, dir_a), (b, dir_b)):
            assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(str(run_dir))
            assert len({env[k] for k in PORTS}) == len(PORTS)
            assert not {env[k] for k in PORTS} & {"8500", "9500"}
        assert a["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] != b["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]
    finally:
        shutil.rmtree(dir_a)
        shutil.rmtree(dir_b)


def test_variables_already_set_win_and_the_python_proxy_keeps_serves_defaults():
    env, run_dir = serve_env({"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "18500"}, "haproxy", LIMIT)
    shutil.rmtree(run_dir)
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == "18500"
    env, run_dir = serve_env({}, "python", LIMIT)
    assert run_dir is None and not any(k.startswith("RAY_SERVE_") for k in env)


def test_haproxys_buffer_holds_more_than_the_gateways_header_limit():
    """Headers the gateway allows must reach it (HAProxy answers an overflow of its buffer with its
    own HTML 400): the buffer is above the limit, never below Serve's default (16 KiB)."""
    env, run_dir = serve_env({}, "haproxy", LIMIT)
    shutil.rmtree(run_dir)
    assert int(env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"]) == haproxy_bufsize(LIMIT) > LIMIT
    assert haproxy_bufsize(1024) >= 16 * 2**10  # AppConfig's smallest limit
    env, run_dir = serve_env({"RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "65536"}, "haproxy", LIMIT)
    shutil.rmtree(run_dir)
    assert env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == "65536"  # the operator's value wins


def test_the_header_limit_is_the_largest_of_the_configs_loraplex_apps():
    app = {"import_path": "app.main:build_app", "args": {}}
    other = {"import_path": "elsewhere:app", "args": {"max_header_bytes": 10**9}}
    assert largest_header_bytes({"applications": [app, other]}) == LIMIT  # AppConfig's default
    bigger = {"import_path": "app.main:build_app", "args": {"max_header_bytes": 200_000}}
    assert largest_header_bytes({"applications": [app, bigger]}) == 200_000
    assert largest_header_bytes({}) == LIMIT
