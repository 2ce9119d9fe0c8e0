"""benchmarks/serving.py's per-server options of loraplex servers."""

from __future__ import annotations

import pytest

from benchmarks.serving import engine_overrides


def test_engine_settings_go_to_the_named_loraplex_server_only():
    kinds = ["vllm", "loraplex", "rot-on"]  # rot-on: a --loraplex-checkout server
    out = engine_overrides(["loraplex=max_loras=2", "rot-on=max_loras=2", "rot-on=slot_quantum_s=0.5",
                            "rot-on=enable_prefix_caching=false"], kinds)
    assert out == {"loraplex": {"max_loras": 2},
                   "rot-on": {"max_loras": 2, "slot_quantum_s": 0.5,
                              "extra_engine_args": {"enable_prefix_caching": False}}}


@pytest.mark.parametrize("spec", ["vllm=max_loras=2", "other=max_loras=2", "loraplex=max_loras", "loraplex"])
def test_a_setting_for_no_loraplex_server_or_without_a_value_is_refused(spec):
    with pytest.raises(SystemExit, match="--loraplex-engine"):
        engine_overrides([spec], ["vllm", "loraplex"])


@pytest.mark.parametrize("module", ["benchmarks.serving", "benchmarks.profiling.serving_cpu"])
def test_both_serving_benchmarks_read_the_per_server_options_alike(module, tmp_path):
    """The side-by-side benchmark and its CPU profile take the same options the same way: what a
    launcher reads (topology, proxy, engine settings, checkouts) is set on the parsed arguments."""
    import importlib

    from benchmarks.serving import resolve_servers

    (tmp_path / "app" / "cli").mkdir(parents=True)
    (tmp_path / "app" / "cli" / "main.py").write_text("")
    parser = importlib.import_module(module).__dict__.get("serving_parser") or importlib.import_module(
        module).build_parser
    args = parser().parse_args([
        "--servers", "vllm,loraplex", "--concurrency", "1,16", "--loraplex-topology", "loraplex=colocated",
        "--loraplex-checkout", f"old={tmp_path}", "--loraplex-proxy", "old=python",
        "--loraplex-engine", "old=max_loras=2"])
    assert resolve_servers(args) == ["vllm", "loraplex", "old"]
    assert args.topologies == {"loraplex": "colocated"} and args.proxies == {"old": "python"}
    assert args.engines == {"old": {"max_loras": 2}} and args.concurrency == [1, 16]
    assert args.checkouts == {"old": tmp_path}


def test_the_cpu_profile_tells_the_replicas_of_both_topologies_apart():
    from benchmarks.profiling.serving_cpu import role_of

    assert role_of("ray::ServeReplica:loraplex:Gateway") == "gateway replica"
    assert role_of("ray::ServeReplica:loraplex:Engine.handle_request_streaming") == "engine replica"
    assert role_of("ray::ServeReplica:loraplex:Server") == "colocated replica (gateway and engine)"
    assert role_of("ray::ServeController") == "Serve controller"


def test_loraplex_frames_count_as_loraplex_code_with_relative_or_absolute_paths():
    from benchmarks.profiling.serving_cpu import layer_of

    assert layer_of(["run (asyncio/events.py:80)", "ManifestCache.get (app/engine/manifests.py:34)"]) == "loraplex code"
    assert layer_of(["Gateway._answer (/srv/loraplex/app/gateway/ingress.py:190)"]) == "loraplex code"
    assert layer_of(["App.__call__ (fastapi/applications.py:1054)"]) == "ASGI / HTTP (uvicorn, starlette, fastapi)"
