"""``app.cli.serve_env``: what ``loraplex serve`` sets so stacks on one machine share nothing."""

from __future__ import annotations

import shutil

from app.cli.serve_env import serve_env

PORTS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def test_two_haproxy_stacks_get_their_own_files_and_ports():
    """Serve's fixed fallback proxy port (8500) would let a starting stack's HAProxy answer with
    another stack's application (seen: a second stack's readiness probe answered by the first)."""
    a, dir_a = serve_env({}, "haproxy")
    b, dir_b = serve_env({}, "haproxy")
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
    env, run_dir = serve_env({"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "18500"}, "haproxy")
    shutil.rmtree(run_dir)
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == "18500"
    env, run_dir = serve_env({}, "python")
    assert run_dir is None and not any(k.startswith("RAY_SERVE_") for k in env)
