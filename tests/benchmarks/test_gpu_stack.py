"""``benchmarks/gpu_stack.py``: the plans, their order and estimate; the same requests for every
system; targets without figures print as missing; and the engine-alone target run for real on
the embedded model (the shape warm-up and sweep first; its records: every request's tokens, TTFT
within its end-to-end time)."""

from __future__ import annotations

import time

from pathlib import Path

import pytest
import yaml

from benchmarks.gpu_stack_parts.models import StackReport
from benchmarks.gpu_stack_parts.plan import (
    PROFILES,
    SYSTEMS,
    adapter_bytes,
    build_plan,
    estimate,
    format_plan,
    phase_s,
    rebuild_plan,
)
from benchmarks.gpu_stack_parts.targets import targets_table
from benchmarks.loadgen.spec import LoadSpec, TargetSpec
from benchmarks.loadgen.workload import model_sequence, prompt_ids


def test_each_system_starts_once_in_order_with_the_seed_phase_first():
    for name, model in (("tiny", "embedded"), ("default", "gptoss-mxfp4"), ("full", "gptoss")):
        plan = build_plan(name, model)
        assert [b.system for b in plan.blocks] == list(SYSTEMS)
        seed = f"c{plan.workload.concurrency}"
        for b in plan.blocks:
            names = [p.name for p in b.phases]
            assert names[0] == seed and len(set(names)) == len(names)
            assert all(p.adapters == 0 for p in b.phases) == (b.system == "vllm-base")
        lp = next(b for b in plan.blocks if b.system == "loraplex")
        sets = [p for p in lp.phases if p.name.startswith("ws")]
        assert sets and all(p.adapters > plan.workload.slots for p in sets)
        assert {p.popularity.split(":")[0] for p in sets} == {"round-robin", "zipf"}
        assert lp.cold_starts >= 1 and next(b for b in plan.blocks if b.system == "engine-alone").route_check


def test_the_default_plan_is_the_seed_workload_and_full_adds_the_variants():
    default, full = build_plan("default", "gptoss-mxfp4"), build_plan("full", "gptoss-mxfp4")
    w = default.workload
    assert (w.input_len, w.output_len, w.concurrency, w.adapters, w.rank, w.slots) == (1600, 600, 16, 8, 32, 8)
    # the seed concurrency, one request at a time and 4x the seed: the plot's three points per system
    assert {p.concurrency for b in default.blocks for p in b.phases} == {1, 16, 64}
    assert all(p.concurrency == 16 for b in default.blocks for p in b.phases if p.name.startswith("ws"))
    assert {p.concurrency for b in full.blocks for p in b.phases} == {1, 4, 16, 64}
    assert full.families() == {16: 8, 32: 64, 64: 8}
    assert full.families(("vllm-lora", "engine-alone")) == {16: 8, 32: 8, 64: 8}
    assert default.families() == {32: 16}


def test_plans_restricted_and_mismatched():
    plan = build_plan("default", "gptoss", ("engine-alone", "loraplex"))
    assert [b.system for b in plan.blocks] == ["loraplex", "engine-alone"]
    assert plan.blocks[1].route_check
    assert not build_plan("default", "gptoss", ("engine-alone",), route_check=False).blocks[0].route_check
    with pytest.raises(ValueError):
        build_plan("tiny", "gptoss")
    with pytest.raises(ValueError):
        build_plan("default", "embedded")


def test_a_phase_selection_runs_only_those_phases_and_is_rebuilt_from_the_report():
    plan = build_plan("full", "gptoss-mxfp4", phases=["ws64-round-robin", "ws64-zipf"], cold_starts=0)
    assert [b.system for b in plan.blocks] == ["loraplex"]  # no other system has these phases
    assert [p.name for p in plan.blocks[0].phases] == ["ws64-round-robin", "ws64-zipf"]
    assert plan.blocks[0].cold_starts == 0 and plan.cold_starts() == 0
    assert plan.families() == {32: 64}
    assert rebuild_plan(plan.model_dump(), ("loraplex",)) == plan
    seed = build_plan("default", "gptoss-mxfp4", phases=["c16"], cold_starts=2)
    assert all([p.name for p in b.phases] == ["c16"] for b in seed.blocks) and len(seed.blocks) == len(SYSTEMS)
    assert [b.cold_starts for b in seed.blocks if b.cold_starts] == [2]
    with pytest.raises(ValueError, match="ws65"):
        build_plan("full", "gptoss", phases=["ws65"])


def test_cross_checked_phases_are_http_phases_kept_in_the_plan_and_estimated():
    plan = build_plan("default", "gptoss-mxfp4", ("vllm-base", "loraplex", "engine-alone"), phases=["c16"],
                      cross_checked=["c16"])
    assert plan.cross_checked == ["c16"]
    steps = dict(estimate(plan))
    # loraplex runs the phase once more with one key, then vllm bench; a stock server vllm bench only
    assert steps["loraplex beside vllm bench"] > steps["vllm-base beside vllm bench"] > 0
    assert "engine-alone beside vllm bench" not in steps
    assert rebuild_plan(plan.model_dump(), ("vllm-base", "loraplex", "engine-alone")) == plan
    assert rebuild_plan(plan.model_dump(), ("engine-alone",)).cross_checked == []  # no HTTP system left
    with pytest.raises(ValueError, match="c16"):
        build_plan("default", "gptoss-mxfp4", ("engine-alone",), cross_checked=["c16"])
    with pytest.raises(ValueError, match="c17"):
        build_plan("default", "gptoss-mxfp4", cross_checked=["c17"])


def test_runs_of_other_phase_selections_do_not_merge():
    from benchmarks.gpu_stack import merge_reports

    earlier = _report("default", ("vllm-base",), "first")
    later = _report("default", ("loraplex",), "second")
    later.plan["selected_phases"] = ["c16"]
    with pytest.raises(SystemExit, match="other phases"):
        merge_reports(earlier, later, None, "gptoss-mxfp4")


def test_the_pushes_fill_a_store_that_outlives_the_command_once(s3_server, tmp_path, capsys):
    """``--pushes-only`` into a running server: every adapter of the selection published once, the
    folders nobody else reads removed; a second command finds them there and pushes none."""
    import signal

    from benchmarks.gpu_stack import main
    from benchmarks.gpu_stack_parts.pushes import running_s3, published

    args = ["--model", "embedded", "--plan", "tiny", "--systems", "loraplex", "--phases", "ws4-round-robin",
            "--cold-starts", "0", "--s3-endpoint", s3_server.endpoint, "--pushes-only", "--workdir", str(tmp_path)]
    term = signal.getsignal(signal.SIGTERM)
    try:
        assert main(args) == 0
        first = capsys.readouterr().out
        assert main(args) == 0
        second = capsys.readouterr().out
    finally:
        signal.signal(signal.SIGTERM, term)
    ids = [f"r8-{i}" for i in range(4)]
    assert all(f"push {a} (" in first and ": ok in" in first for a in ids)
    with running_s3(s3_server.endpoint) as store:
        assert published(store) == set(ids)
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["template-r8"]
    assert "4 adapters already in the store" in second and "push r8-" not in second


def test_the_estimate_adds_up_and_orders_the_plans():
    default, full = build_plan("default", "gptoss-mxfp4"), build_plan("full", "gptoss-mxfp4")
    steps = estimate(default)
    names = [s for s, _ in steps]
    push = next(n for n in names if n.startswith("push "))
    assert names[2:] == [*SYSTEMS[:3], push, *SYSTEMS[3:], "engine-alone routing check"]
    assert names[1] == "write 8 adapters" and "16 adapters" in push and "while loraplex starts" in push
    assert all(t > 0 for _, t in steps)
    assert sum(t for _, t in estimate(full)) > 1.5 * sum(t for _, t in steps)
    assert 15 * 60 < sum(t for _, t in steps) < 30 * 60  # "about 20 minutes on one H200"
    # loraplex's pushes overlap its start: the two together take the longer of them
    prof = PROFILES["gpu"]
    lp = next(b for b in default.blocks if b.system == "loraplex")
    rest = prof.stop_s + sum(phase_s(p, prof) for p in lp.phases)
    cold = dict(steps)["loraplex"] - rest
    assert dict(steps)[push] + max(prof.start_s["loraplex"] - dict(steps)[push], 0) == pytest.approx(
        max(prof.start_s["loraplex"], dict(steps)[push]))
    assert cold > 0  # the cold start's own push and requests
    without = estimate(build_plan("default", "gptoss-mxfp4", tuple(s for s in SYSTEMS if s != "loraplex")))
    assert not any(n.startswith("push ") for n, _ in without)
    text = format_plan(default)
    assert "estimate:" in text and "total" in text and "adapter bytes" in text
    # a phase: its waves of prefill and decode, plus the warm-up's
    lora = next(b for b in default.blocks if b.system == "vllm-lora").phases[0]
    prof = PROFILES["gpu"]
    one = lora.concurrency * lora.input_len / prof.prefill_tok_s
    assert phase_s(lora, prof) == pytest.approx(
        (one + 16 * prof.lora_step_ms / 1e3) + lora.requests / lora.concurrency * (one + 600 * prof.lora_step_ms / 1e3))


def test_adapter_bytes_scale_with_rank():
    assert adapter_bytes(64) == 2 * adapter_bytes(32) == 4 * adapter_bytes(16)
    assert 700 < adapter_bytes(32) / 2**20 < 710
    assert adapter_bytes(32, expert_lora=False) < adapter_bytes(32) / 10


def test_every_system_gets_the_same_requests_of_a_phase():
    from benchmarks.gpu_stack_parts.runner import Context, load_specs

    plan = build_plan("default", "gptoss")
    ctx = Context(plan=plan, workdir=Path("."), assets=None, serve_config=Path("x"), serve_cfg={}, engine_args={},
                  store=None, keys={}, adapters={}, vocab=1000, special=[0, 1], host={}, timeout_s=60)
    phase = next(b for b in plan.blocks if b.system == "vllm-lora").phases[0]
    specs = [load_specs(ctx, phase, TargetSpec(name=n, base_url="http://x")) for n in ("vllm-lora", "engine-alone")]
    (wa, ma), (wb, mb) = specs
    for a, b in ((wa, wb), (ma, mb)):
        assert [prompt_ids(a, "measure", i) for i in range(3)] == [prompt_ids(b, "measure", i) for i in range(3)]
        seq = model_sequence(a, "measure", a.num_requests, a.popularity)
        assert seq == model_sequence(b, "measure", b.num_requests, b.popularity)
    assert ma.seed != wa.seed and wa.output_len < ma.output_len and wa.num_requests == phase.warmup
    assert prompt_ids(ma, "measure", 0) != prompt_ids(wa, "measure", 0)


def test_targets_without_figures_print_as_missing():
    plan = build_plan("default", "gptoss")
    report = StackReport(date="now", command="x", plan={}, estimate_s=0)
    rows = targets_table(report, plan)[2:]
    assert len(rows) == 8
    assert all(r.endswith("| missing |") for r in rows)


@pytest.mark.e2e
def test_engine_alone_target_measures_every_request(loraplex_home, embedded_model_dir, tmp_path):
    from adapters_registry.stores import open_store
    from app.engine.shape_warmup import token_counts
    from benchmarks.gpu_stack_parts.engine_alone import EngineJob, JobPhase
    from benchmarks.gpu_stack_parts.runner import Context, sweep_specs
    from benchmarks.gpu_stack_parts.systems import run_engine_child
    from benchmarks.loadgen.workload import model_vocab

    adapter = "acme-support"
    folder = loraplex_home / "store" / adapter / str(open_store((loraplex_home / "store").as_uri()).get(adapter).version)
    engine = {"model": str(embedded_model_dir), "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
              "max_num_batched_tokens": 256, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8,
              "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "cpu_kvcache_space_gib": 1}
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "app.main:build_app",
                                                        "args": {"engine": engine}}]}))
    vocab, special = model_vocab(embedded_model_dir)
    spec = LoadSpec(target=TargetSpec(name="engine-alone", base_url="in-process", base_model="loraplex-base"),
                    adapters=[adapter], input_len=8, output_len=6, concurrency=2, num_requests=4, warmup_requests=2,
                    vocab_size=vocab, exclude_token_ids=special, temperature=1.0)
    ctx = Context(plan=None, workdir=tmp_path, assets=None, serve_config=config, serve_cfg=yaml.safe_load(config.read_text()),
                  engine_args={}, store=None, keys={}, adapters={}, vocab=vocab, special=special, host={}, timeout_s=60)
    job = EngineJob(serve_config=config, adapters={adapter: folder}, shape_sweep=sweep_specs(ctx, spec.target),
                    phases=[JobPhase(name="c2", warmup=spec.model_copy(update={"output_len": 2}), measure=spec)])
    out, child = run_engine_child(tmp_path, "engine-alone", job, {"LORAPLEX_HOME": str(loraplex_home)})
    assert out.error is None, out.error
    assert out.start_s and out.start_s > 0 and child.pids() == []
    # the built-in warm-up (as a replica runs it) and the sweep every system gets, each request alone
    assert out.shape_warmup.limit == 255 and out.shape_warmup.token_counts == token_counts(255)
    sweep = out.shape_sweep
    assert sweep.token_counts == token_counts(255) and sweep.failures == 0 and min(sweep.seconds) > 0, sweep
    (phase,) = out.phases
    assert phase.warmup_requests == 4 and phase.warmup_failures == 0
    assert phase.warmup_at <= phase.measured_at <= phase.ended_at  # wall-clock strings, to read server logs by
    assert phase.ended_at[:4] == time.strftime("%Y") and len(phase.ended_at) == len("2026-01-01 00:00:00.000")
    r = phase.result
    assert r.system == "engine-alone" and r.warmup_requests == 2 and r.warmup_failures == 0
    assert [x.adapter for x in r.records] == [None, adapter, None, adapter]
    for x in r.records:
        assert x.ok and x.error is None and x.status is None
        assert x.output_tokens == 6 and x.prompt_tokens == 8 and x.token_source == "usage-per-chunk"
        assert 0 < x.ttft_ms <= x.e2e_ms and len(x.itl_ms) == 5 and x.tpot_ms > 0
    a = r.aggregate
    assert a.requests == 4 and a.failures == 0 and a.token_mismatches == 0 and a.output_throughput_tok_s > 0


def _report(plan_name: str, systems: tuple[str, ...], date: str) -> StackReport:
    from benchmarks.gpu_stack_parts.models import PushRecord, SystemRun

    plan = build_plan(plan_name, "gptoss-mxfp4", systems)
    return StackReport(date=date, command=f"run at {date}", plan=plan.model_dump(), estimate_s=60.0, wall_s=100.0,
                       pushes=[PushRecord(adapter=f"{date}-a", tenant="tenant-1", rank=32, seconds=1.0, ok=True)],
                       systems=[SystemRun(system=s, label=s, error=f"{s} at {date}") for s in systems])


def test_two_runs_of_one_plan_merge_into_one_report_in_the_plans_order():
    from benchmarks.gpu_stack import merge_reports

    earlier = _report("default", ("vllm-base", "vllm-lora", "engine-alone"), "first")
    later = _report("default", ("loraplex", "engine-alone"), "second")
    merged, plan = merge_reports(earlier, later, None, "gptoss-mxfp4")
    assert [s.system for s in merged.systems] == ["vllm-base", "vllm-lora", "loraplex", "engine-alone"]
    assert [b.system for b in plan.blocks] == [s.system for s in merged.systems]
    assert next(s for s in merged.systems if s.system == "engine-alone").error == "engine-alone at second"
    assert [p.adapter for p in merged.pushes] == ["first-a", "second-a"]
    assert merged.wall_s == 200.0 and "first" in merged.date and "second" in merged.date
    with pytest.raises(SystemExit, match="plan 'full'"):
        merge_reports(_report("full", ("vllm-base",), "x"), later, None, "gptoss-mxfp4")


def _phase(system: str, plan, ttft: float, itl: float, tpot: float, rate: float):
    from benchmarks.gpu_stack_parts.models import PhaseResult
    from benchmarks.loadgen.spec import LoadResult, Percentiles, PhaseAggregate

    def pct(x: float) -> Percentiles:
        return Percentiles(mean=x, p50=x, p90=x, p99=x)

    w = plan.workload
    spec = LoadSpec(target=TargetSpec(name=system, base_url="http://x"), input_len=w.input_len, output_len=w.output_len,
                    concurrency=w.concurrency, num_requests=4, vocab_size=1000)
    agg = PhaseAggregate(requests=4, failures=0, token_mismatches=0, multi_token_chunk_requests=0, wall_s=1.0,
                         ttft_ms=pct(ttft), itl_ms=pct(itl), tpot_ms=pct(tpot), tokens_per_s_per_request=rate,
                         output_throughput_tok_s=4 * rate)
    return PhaseResult(name=f"c{w.concurrency}", warmup_requests=0, warmup_failures=0,
                       result=LoadResult(system=system, spec=spec, warmup_requests=0, warmup_failures=0, records=[],
                                         aggregate=agg))


def test_runs_that_started_their_workers_differently_do_not_merge():
    """Staggered starts change what TTFT measures (no synchronized waves): one table may not mix them."""
    from benchmarks.gpu_stack import merge_reports
    from benchmarks.gpu_stack_parts.models import SystemRun

    plan = build_plan("default", "gptoss-mxfp4")
    together = _phase("vllm-base", plan, 50.0, 10.0, 10.5, 90.0)
    staggered = _phase("loraplex", plan, 50.0, 10.0, 10.5, 90.0)
    staggered.result.spec.staggered_starts = True
    earlier = StackReport(date="a", command="x", plan=plan.model_dump(), estimate_s=0,
                          systems=[SystemRun(system="vllm-base", label="a", phases=[together])])
    later = StackReport(date="b", command="y", plan=plan.model_dump(), estimate_s=0,
                        systems=[SystemRun(system="loraplex", label="d", phases=[staggered])])
    with pytest.raises(SystemExit, match="staggered"):
        merge_reports(earlier, later, None, "gptoss-mxfp4")
    together.result.spec.staggered_starts = True
    merged, _ = merge_reports(earlier, later, None, "gptoss-mxfp4")
    assert [s.system for s in merged.systems] == ["vllm-base", "loraplex"]


def test_the_decode_step_is_the_median_gap_between_tokens_not_tpot():
    """A stall (a compile, a prefill in the batch) lifts TPOT; the decode-step target reads ITL p50."""
    from benchmarks.gpu_stack_parts.models import SystemRun

    plan = build_plan("default", "gptoss-mxfp4")
    runs = [SystemRun(system="vllm-base", label="a", phases=[_phase("vllm-base", plan, 50.0, 10.0, 10.5, 90.0)]),
            SystemRun(system="loraplex", label="d", phases=[_phase("loraplex", plan, 55.0, 12.0, 20.0, 60.0)])]
    report = StackReport(date="now", command="x", plan={}, estimate_s=0, systems=runs)
    step = next(r for r in targets_table(report, plan) if r.startswith("| (d) decode step"))
    assert "1.20× (12.00 / 10.00)" in step and step.endswith("| met |"), step  # TPOT would say 1.90×


@pytest.mark.parametrize("topology", ["split", "colocated"])
def test_the_gpu_hosts_serve_config_is_one_loraplex_serve_accepts_in_either_topology(tmp_path, topology):
    """deploy/h200.yaml as the GPU host rewrites it (store, tenants, cache, model, one replica
    each), with --loraplex-topology: `loraplex serve` finds nothing to refuse (a colocated run was
    once rejected by Serve for split's per-deployment overrides) and the engine section is the
    file's with only the model changed."""
    from app.cli.serve_config_check import config_problems
    from benchmarks.gpu_stack_parts.assets import ModelAssets
    from benchmarks.gpu_stack_parts.serve_config import H200_CONFIG, host_config

    assets = ModelAssets(kind="gptoss-mxfp4", model_dir=tmp_path / "model", home=tmp_path / "home",
                         engine={"model": str(tmp_path / "model"), "load_format": "dummy"}, gpu=True)
    cfg = host_config(assets, tmp_path, "s3://bucket/bench", "http://127.0.0.1:9", tmp_path / "tenants.yaml", 2**30)
    args = cfg["applications"][0]["args"]
    args["topology"] = topology
    assert config_problems(cfg) == []
    assert args["engine_deployment"]["num_replicas"] == 1 and "autoscaling_config" not in args["engine_deployment"]
    assert args["engine_deployment"]["max_surge_percent"] == 25 and args["cache_max_bytes"] == 2**30
    assert args["s3"]["download_concurrency"] == 1  # one GET per file against moto, whatever the file says
    import yaml

    file_engine = yaml.safe_load(H200_CONFIG.read_text())["applications"][0]["args"]["engine"]
    assert {k: v for k, v in args["engine"].items() if k not in ("model", "load_format")} == \
        {k: v for k, v in file_engine.items() if k != "model"}


def test_the_registered_adapters_budget_is_lowered_to_the_hosts_memory_never_raised(tmp_path):
    from benchmarks.gpu_stack_parts.assets import ModelAssets
    from benchmarks.gpu_stack_parts.serve_config import H200_CONFIG, host_config

    assets = ModelAssets(kind="gptoss-mxfp4", model_dir=tmp_path / "model", home=tmp_path / "home",
                         engine={"model": str(tmp_path / "model"), "load_format": "dummy"}, gpu=True)
    file_gib = yaml.safe_load(H200_CONFIG.read_text())["applications"][0]["args"]["engine"]["max_cpu_lora_gib"]

    def budget(host_bytes):
        cfg = host_config(assets, tmp_path, "s3://b/p", "http://127.0.0.1:9", tmp_path / "t.yaml", 2**30,
                          host_lora_max_bytes=host_bytes)
        return cfg["applications"][0]["args"]["engine"]["max_cpu_lora_gib"]

    assert budget(24 * 2**30) == 24.0
    assert budget(int(4 * file_gib) * 2**30) == file_gib
    assert budget(None) == file_gib


def test_a_cold_starts_load_steps_come_from_its_request_log_line(tmp_path):
    """The cold request's engine line carries the load it waited for; other adapters' lines, the
    gateway's line and lines without a load are passed over; the targets row prints the steps."""
    from app.logging_json import RequestLog
    from benchmarks.gpu_stack_parts.adapter_loads import load_steps
    from benchmarks.gpu_stack_parts.models import ColdStart
    from benchmarks.gpu_stack_parts.targets import cold_row

    steps = {"disk_s": 1.14, "checks_s": 0.004, "add_lora_s": 1.33}
    lines = [RequestLog(component="engine", request_id="a", status=200, adapter="r32-1",
                        adapter_load={"disk_s": 9.0, "checks_s": 0.0, "add_lora_s": 9.0}),
             RequestLog(component="gateway", request_id="b", status=200, adapter="cold-r32-0"),
             RequestLog(component="engine", request_id="b", status=200, adapter="cold-r32-0", adapter_load=steps),
             RequestLog(component="engine", request_id="c", status=200, adapter="cold-r32-0")]
    log = tmp_path / "loraplex.log"
    log.write_text("INFO starting\n" + "".join(f"(ServeReplica pid=1) {r.model_dump_json(exclude_none=True)}\n"
                                               for r in lines))
    assert load_steps(log, "cold-r32-0") == steps
    assert load_steps(log, "cold-r32-9", timeout_s=0.0) is None

    from app.gateway.tenants import TenantDirectory
    from benchmarks.gpu_stack_parts.assets import OPERATOR, write_tenants

    keys = write_tenants(tmp_path / "tenants.yaml")  # the run's operator key reads every replica's metrics
    assert TenantDirectory(tmp_path / "tenants.yaml").authenticate(f"Bearer {keys[OPERATOR]}").operator

    report = _report("default", ("loraplex",), "x")
    report.systems[0].error = None
    report.systems[0].cold_starts = [ColdStart(adapter="cold-r32-0", adapter_bytes=739679531, cold_ttft_ms=2369.0,
                                               warm_ttft_ms=89.0, disk_load_s=1.14, add_lora_s=1.33,
                                               engine_load_s=2.47)]
    row = cold_row(report, build_plan("default", "gptoss-mxfp4"))
    assert "2.37 s" in row and "NOT met" in row
    assert "download + verify 1.14 s, add_lora 1.33 s, miss to add_lora returning 2.47 s" in row


def test_engine_settings_reach_every_systems_engine_arguments(tmp_path):
    """--engine-set: an EngineConfig field lands at the engine section's top, anything else among
    the vLLM arguments; the stock servers' arguments (derived from that section) carry both."""
    from benchmarks.gpu_stack import build_parser
    from benchmarks.stacks.engine_settings import apply_engine_settings
    from benchmarks.gpu_stack_parts.assets import ModelAssets
    from benchmarks.gpu_stack_parts.serve_config import host_config, stock_engine_args

    args = build_parser().parse_args(["--engine-set", "max_lora_rank=32", "--engine-set", "enable_prefix_caching=false"])
    assert args.engine_set == [("max_lora_rank", 32), ("enable_prefix_caching", False)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine-set", "max_lora_rank"])
    assets = ModelAssets(kind="gptoss-mxfp4", model_dir=tmp_path / "model", home=tmp_path / "home",
                         engine={"model": str(tmp_path / "model"), "load_format": "dummy"}, gpu=True)
    cfg = host_config(assets, tmp_path, "s3://bucket/bench", "http://127.0.0.1:9", tmp_path / "tenants.yaml", 2**30)
    engine = cfg["applications"][0]["args"]["engine"]
    apply_engine_settings(engine, args.engine_set)
    assert engine["max_lora_rank"] == 32 and engine["extra_engine_args"]["enable_prefix_caching"] is False
    stock = stock_engine_args(cfg)
    assert stock["max_lora_rank"] == 32 and stock["enable_prefix_caching"] is False
    # stock vLLM runs its own scheduler: none of loraplex's rules (deploy/h200.yaml turns them on)
    assert not {"scheduler_cls", "scheduling_policy", "additional_config", "worker_extension_cls"} & set(stock)


def test_a_published_report_names_no_host_path_and_keeps_aggregates_only():
    """``publish.publishable``: the interpreter, the checkout, the work and output folders and a
    merged file are named by role in every field; records go, aggregates stay."""
    from benchmarks.gpu_stack_parts.models import SystemRun
    from benchmarks.gpu_stack_parts.publish import RUN_SEPARATOR, publishable
    from benchmarks.loadgen.spec import RequestRecord

    plan = build_plan("default", "gptoss-mxfp4")
    phase = _phase("loraplex", plan, 50.0, 10.0, 10.5, 90.0)
    phase.result.records = [RequestRecord(index=0, adapter="a", model="a", start_s=0.0, status=200, ok=True,
                                          expected_output_tokens=4)]
    run = "/venv/x/bin/python3 /src/co/benchmarks/gpu_stack.py --out /scratch/out/gsL --workdir /scratch/wd"
    command = run + RUN_SEPARATOR + run.replace("gsL", "gsE") + " --merge /scratch/gsL.json"
    report = StackReport(date="d", command=command, plan=plan.model_dump(), estimate_s=0, systems=[
        SystemRun(system="loraplex", label="d", phases=[phase], log="/scratch/wd/loraplex/loraplex.log",
                  command="/venv/x/bin/python3 -m app.cli.main serve /scratch/wd/loraplex/config.yaml")])
    published = publishable(report)
    text = published.model_dump_json()
    assert not any(p in text for p in ("/venv", "/src/co", "/scratch"))
    assert published.command.startswith("python3 benchmarks/gpu_stack.py --out $OUT/gsL --workdir $GPU_STACK_WORKDIR")
    assert published.command.endswith("--merge <earlier run>/gpu_stack.json")
    assert published.systems[0].log == "$GPU_STACK_WORKDIR/loraplex/loraplex.log"
    assert published.systems[0].command == "python3 -m app.cli.main serve $GPU_STACK_WORKDIR/loraplex/config.yaml"
    assert published.systems[0].phases[0].result.records == []
    assert published.systems[0].phases[0].result.aggregate == phase.result.aggregate
    assert report.systems[0].phases[0].result.records  # the report given is left as it was


def test_a_published_report_with_failed_phases_still_prints_its_tables():
    """Records go when a report is published; its failures are then printed by count and status."""
    from benchmarks.gpu_stack_parts.models import SystemRun
    from benchmarks.gpu_stack_parts.output import summary_text
    from benchmarks.gpu_stack_parts.publish import publishable
    from benchmarks.loadgen.spec import RequestRecord

    plan = build_plan("default", "gptoss-mxfp4", ("loraplex",))
    phase = _phase("loraplex", plan, 50.0, 10.0, 10.5, 90.0)
    phase.result.aggregate.failures, phase.result.aggregate.errors = 1, {"None": 1}
    phase.result.records = [RequestRecord(index=0, adapter="a", model="a", start_s=0.0, status=None, ok=False,
                                          expected_output_tokens=4, error="ClientConnectorError: refused")]
    report = StackReport(date="d", command="c", plan=plan.model_dump(), estimate_s=0,
                         systems=[SystemRun(system="loraplex", label="d", phases=[phase])])
    assert "1 failed with status None: ClientConnectorError: refused" in summary_text(report, plan)
    assert "1 failed with status None\n" in summary_text(publishable(report), plan)


def test_a_committed_report_gets_its_paths_named_and_nothing_else(tmp_path):
    """``--paths-only`` on a report written by an older version (fields it lacks stay absent), whose
    top command was already made portable by hand: the systems' interpreter is still found."""
    from benchmarks.gpu_stack_parts.publish import main

    text = ('{"date": "d", "command": "python3 benchmarks/gpu_stack.py --workdir /scratch/wd", "plan": {}, '
            '"estimate_s": 0, "systems": [{"system": "vllm-base", "label": "a", '
            '"command": "/venv/x/bin/python3 -m vllm --lora-modules a=/scratch/wd/adapters/a", '
            '"log": "/scratch/wd/vllm-base.log"}]}')
    path = tmp_path / "r.json"
    path.write_text(text)
    assert main(["--paths-only", str(path)]) == 0
    assert path.read_text() == text.replace("/venv/x/bin/python3", "python3").replace("/scratch/wd", "$GPU_STACK_WORKDIR")


@pytest.mark.e2e
def test_vllm_bench_beside_a_phase_sends_the_same_requests_with_one_key(serve_stack, embedded_model_dir, tmp_path,
                                                                        monkeypatch, capsys):
    """``--vllm-bench``'s cross-check (``beside(..., same_key=True)``) on a target with per-tenant keys: our phase again with the
    operator's key for every model, then vllm bench with that key on the same models; both
    complete every request with the requested tokens, and the comparison table prints both."""
    from benchmarks.gpu_stack_parts.models import CrossCheck
    from benchmarks.gpu_stack_parts.output import summary_text
    from benchmarks.loadgen.client import run
    from benchmarks.loadgen.vllm_bench import beside
    from benchmarks.loadgen.workload import model_vocab

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    vocab, special = model_vocab(embedded_model_dir)
    acme, globex = serve_stack.keys["acme"], serve_stack.keys["globex"]
    target = TargetSpec(name="loraplex", base_url=serve_stack.base_url, base_model="loraplex-base",
                        keys={"loraplex-base": acme, "acme-support": acme, "globex-legal": globex})
    spec = LoadSpec(target=target, adapters=["acme-support", "globex-legal"], include_base=True, input_len=8,
                    output_len=4, concurrency=2, num_requests=6, warmup_requests=0, vocab_size=vocab,
                    exclude_token_ids=special, seed=5)
    measured = run(spec)
    ours, bench = beside(measured, serve_stack.keys["operator"], embedded_model_dir, tmp_path / "bench",
                         same_key=True)
    check = CrossCheck(phase="c2", ours=ours, bench=bench)
    assert check.ours is not measured and check.ours.system == "loraplex (one key)"
    assert check.ours.aggregate.requests == 6 and check.ours.aggregate.failures == 0
    assert check.bench.rc == 0, (tmp_path / "bench" / "vllm-bench-loraplex-c2.log").read_text()[-2000:]
    assert check.bench.models == ["loraplex-base", "acme-support", "globex-legal"]
    assert check.bench.note == "the same key on both clients"
    assert check.bench.figures["completed"] == 6 and check.bench.figures["total_output_tokens"] == 6 * 4
    report = StackReport(date="d", command="c", plan=build_plan("tiny", "embedded").model_dump(), estimate_s=0,
                         host={}, systems=[{"system": "loraplex", "label": "l", "cross_checks": [check]}])
    text = summary_text(report, build_plan("tiny", "embedded"))
    assert "loraplex (one key)" in text and "vllm bench" in text
