"""``benchmarks.stacks``: vLLM's own server and the minimal Ray Serve app started on the embedded
model at tiny settings, the load generator's requests all served by each (base model and an
adapter), and nothing of either left running once stopped; the engine-argument dict read by
vLLM's own parser and mapped onto loraplex's engine config."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.loadgen.client import run
from benchmarks.loadgen.spec import LoadSpec
from benchmarks.loadgen.workload import model_vocab
from benchmarks.stacks.process import marked_pids

ADAPTER = "acme-support"
TINY_ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "max_loras": 1, "max_cpu_loras": 1,
               "max_lora_rank": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _demo_adapter_dir(home: Path, adapter_id: str) -> Path:
    from adapters_registry.stores import open_store

    version = open_store((home / "store").resolve().as_uri()).get(adapter_id).version
    return home / "store" / adapter_id / str(version)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["vllm", "ray-app"])
def test_a_stock_server_serves_every_request_and_leaves_nothing_behind(kind, loraplex_home, embedded_model_dir,
                                                                        tmp_path):
    from benchmarks.stacks.ray_app import RayApp
    from benchmarks.stacks.vllm_server import VllmServer

    launcher = {"vllm": VllmServer, "ray-app": RayApp}[kind]
    server = launcher(tmp_path, embedded_model_dir, TINY_ENGINE, {ADAPTER: _demo_adapter_dir(loraplex_home, ADAPTER)})
    vocab, special = model_vocab(embedded_model_dir)
    with server as target:
        started = server.pids()
        assert server.child.proc.pid in started and server.ready_s > 0
        assert target.base_url.startswith("http://127.0.0.1:") and target.model_name(None) == "base"
        spec = LoadSpec(target=target, adapters=[ADAPTER], input_len=8, output_len=8, concurrency=2,
                        num_requests=4, warmup_requests=2, vocab_size=vocab, exclude_token_ids=special)
        result = run(spec)
    a = result.aggregate
    assert result.warmup_failures == 0 and a.requests == 4 and a.failures == 0 and a.errors == {}
    assert [r.adapter for r in result.records] == [None, ADAPTER, None, ADAPTER]
    assert all(r.ok and r.output_tokens == 8 and r.prompt_tokens == 8 for r in result.records)
    assert a.token_mismatches == 0 and a.ttft_ms is not None and a.output_throughput_tok_s > 0
    # stopped: no process it started is left, whatever group it ended up in
    assert marked_pids(server.child.marker) == []
    assert [pid for pid in started if _running(pid)] == []
    assert server.log_path.stat().st_size > 0
    if kind == "ray-app":
        assert not Path(server.child.env["RAY_TMPDIR"]).exists()
        # its Ray cluster's logs were kept first: Serve's controller and the replica's log
        kept = server.workdir / f"{server.name}-ray-logs"
        serve_logs = [p.name for p in kept.glob("session_*/serve/*.log")]
        assert any(n.startswith("controller_") for n in serve_logs), serve_logs
        assert any(n.startswith("replica_") for n in serve_logs), serve_logs


def test_ray_logs_are_kept_per_session_and_a_large_one_keeps_its_end(tmp_path):
    from benchmarks.stacks.process import keep_ray_logs

    logs = tmp_path / "ray" / "ray" / "session_2026-12-03_16-37-20_1_1" / "logs"
    (logs / "serve").mkdir(parents=True)
    (logs / "serve" / "controller_1.log").write_text("replica died: OOM\n")
    (logs / "raylet.out").write_bytes(b"a" * 100 + b"the end")
    (tmp_path / "ray" / "ray" / "session_latest").symlink_to(logs.parent)  # Ray's link: not copied twice
    kept = keep_ray_logs(tmp_path / "ray", tmp_path / "kept", limit=20)
    base = tmp_path / "kept" / "session_2026-12-03_16-37-20_1_1"
    assert sorted(kept) == sorted([base / "serve" / "controller_1.log", base / "raylet.out"])
    assert (base / "serve" / "controller_1.log").read_text() == "replica died: OOM\n"
    assert (base / "raylet.out").read_bytes() == b"a" * 13 + b"the end"


def test_host_memory_line_reads_this_hosts_counts_and_its_largest_processes(tmp_path, monkeypatch):
    from benchmarks.stacks import host_memory

    line = host_memory.memory_line(top=3)
    assert line.startswith("host memory: used ") and line.count(" GiB ") >= 3  # /proc of this Linux host
    # a cgroup v2 tree as a container has it: the monitor's figure and its parts in GiB
    (tmp_path / "memory.current").write_text(str(40 * 2**30))
    (tmp_path / "memory.max").write_text("max\n")  # unlimited: no limit shown
    (tmp_path / "memory.stat").write_text(f"anon {30 * 2**30}\nactive_file {6 * 2**30}\ninactive_file {4 * 2**30}\n")
    monkeypatch.setattr(host_memory, "CGROUP", tmp_path)
    assert "cgroup 40.0 GiB (anon 30.0, active_file 6.0, inactive_file 4.0)" in host_memory.memory_line()
    (tmp_path / "memory.max").write_text(str(64 * 2**30))
    assert "cgroup 40.0 of 64.0 GiB" in host_memory.memory_line()


def test_a_starting_server_logs_the_hosts_memory_until_it_is_ready(capsys):
    import time

    from benchmarks.stacks.process import _memory_log

    t0 = time.monotonic()
    with _memory_log("vllm-base", t0, every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3 and all(x.startswith("vllm-base: not ready after ") and "host memory: used" in x for x in lines)
    time.sleep(0.2)
    assert capsys.readouterr().out == ""  # stopped with the block


def test_engine_arguments_as_vllms_command_line_and_as_loraplex_engine_config(tmp_path):
    from app.config import EngineConfig
    from benchmarks.stacks.loraplex import engine_section
    from benchmarks.stacks.vllm_server import vllm_arg_parser, vllm_cli_args

    engine = dict(TINY_ENGINE, max_loras=3, max_cpu_loras=5, enforce_eager=True, enable_prefix_caching=False,
                  max_num_batched_tokens=512)
    argv = vllm_cli_args("/models/tiny", "base", engine, {"a1": tmp_path / "a1", "a2": tmp_path / "a2"})
    args = vllm_arg_parser().parse_args(argv)
    assert (args.model, args.served_model_name, args.dtype) == ("/models/tiny", ["base"], "float32")
    assert args.enable_lora is True and (args.max_loras, args.max_cpu_loras, args.max_lora_rank) == (3, 5, 8)
    assert args.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert args.enforce_eager is True and args.enable_prefix_caching is False and args.max_num_batched_tokens == 512
    assert [(m.name, m.path) for m in args.lora_modules] == [("a1", str(tmp_path / "a1")), ("a2", str(tmp_path / "a2"))]
    # without adapters, no LoRA argument reaches vLLM
    plain = vllm_arg_parser().parse_args(vllm_cli_args("/models/tiny", "base", engine, None))
    assert not plain.enable_lora and plain.max_loras != 3 and plain.max_cpu_loras != 5
    assert not plain.lora_modules and plain.lora_target_modules is None

    section = engine_section(dict(engine, enable_lora=True))
    assert section["extra_engine_args"] == {"enable_prefix_caching": False}
    cfg = EngineConfig(**section)
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank) == (3, 5, 8)
    assert cfg.enforce_eager is True and cfg.max_num_batched_tokens == 512
