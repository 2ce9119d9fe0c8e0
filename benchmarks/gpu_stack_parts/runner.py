"""Runs a plan's blocks in order: each system started once, its phases back to back, its extra
measurements (cold starts, the routing check), stopped; a system that fails is recorded and the
run goes on with the next.

Before its phases every system gets the same shape sweep (``ShapeSweep``: one base-model request
per token-count class up to the engines' step limit), so no system compiles a kernel variant in a
measured phase; loraplex's replica and the engine alone also run their own built-in warm-up.

Each phase is two load specs of the same name-derived seed (``load_specs``): a short warm-up
(every adapter and every worker once, a few output tokens, its own prompts) and the measured
closed loop; both go to the HTTP load generator for a server and to the in-process target for
the engine alone, so every system sees the same requests.
"""

from __future__ import annotations

import shutil
import time
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_stack_parts import systems
from benchmarks.gpu_stack_parts.adapter_loads import load_steps
from benchmarks.gpu_stack_parts.assets import OPERATOR, ModelAssets, write_adapters
from benchmarks.gpu_stack_parts.engine_alone import EngineJob, JobPhase, sweep_record
from benchmarks.gpu_stack_parts.models import (
    ColdStart,
    CrossCheck,
    PhaseResult,
    PushRecord,
    ShapeSweep,
    SystemRun,
    wall_clock,
)
from benchmarks.gpu_stack_parts.plan import (
    COLD_PREFIX,
    LABELS,
    WARMUP_TOKENS,
    PhaseSpec,
    Plan,
    SystemBlock,
    adapter_ids,
    cold_id,
    tenant_of,
)
from benchmarks.gpu_stack_parts.pushes import Store, push
from benchmarks.gpu_stack_parts.routes import (
    FORWARDS_ENV,
    LOG_ENV,
    TOKENS_ENV,
    plugin_site,
    summarise,
)
from benchmarks.loadgen.client import run
from benchmarks.loadgen.spec import LoadResult, LoadSpec, TargetSpec
from benchmarks.loadgen.vllm_bench import beside

TEMPERATURE = 1.0
ROUTE_TOKENS = 8


@dataclass
class Context:
    """What the blocks share."""

    plan: Plan
    workdir: Path
    assets: ModelAssets
    serve_config: Path  # loraplex's Serve config (port replaced at start)
    serve_cfg: dict[str, Any]
    engine_args: dict[str, Any]  # for the stock servers
    store: Store
    keys: dict[str, str]  # tenant -> key
    adapters: dict[str, Path]  # adapter id -> local folder (the stock servers', the engine's)
    vocab: int
    special: list[int]
    host: dict[str, str]
    timeout_s: float
    staggered_starts: bool = False  # measured phases' workers start spread (benchmarks.loadgen.closed_loop)
    pushes: list[PushRecord] = field(default_factory=list)
    # loraplex's adapters pushed to the store: run while its engine starts (None once done)
    push_job: Callable[[Context], None] | None = None

    @property
    def served_name(self) -> str:
        return self.serve_cfg["applications"][0]["args"]["engine"]["served_model_name"]


def load_specs(ctx: Context, phase: PhaseSpec, target: TargetSpec) -> tuple[LoadSpec, LoadSpec]:
    """``(warm-up, measured)`` of a phase against ``target``."""
    ids = adapter_ids(phase.rank, phase.adapters)
    seed = zlib.crc32(phase.name.encode())
    measure = LoadSpec(target=target, adapters=ids, include_base=not ids, popularity=phase.popularity,
                       endpoint="completions", input_len=phase.input_len, output_len=phase.output_len,
                       temperature=TEMPERATURE, concurrency=phase.concurrency, num_requests=phase.requests,
                       warmup_requests=0, vocab_size=ctx.vocab, exclude_token_ids=ctx.special, seed=seed,
                       timeout_s=ctx.timeout_s, staggered_starts=ctx.staggered_starts)
    warm = measure.model_copy(update={"output_len": WARMUP_TOKENS, "num_requests": phase.warmup,
                                      "popularity": "round-robin", "seed": seed + 1, "staggered_starts": False})
    return warm, measure


def keys_for(ctx: Context, ids: list[str]) -> dict[str, str]:
    """Bearer key per adapter id (its owner's) and for the base model (the first tenant's)."""
    keys = {a: ctx.keys[tenant_of(int(a.rsplit("-", 1)[1]))] for a in ids}
    keys[ctx.served_name] = ctx.keys[tenant_of(0)]
    return keys


def _log_phase(system: str, p: PhaseResult) -> None:
    a = p.result.aggregate

    def ms(x):
        return f"{x.p50:.1f}" if x else "-"

    print(f"{system} {p.name}: {a.requests - a.failures}/{a.requests} ok, TTFT p50 {ms(a.ttft_ms)} ms, "
          f"TPOT p50 {ms(a.tpot_ms)} ms, {a.tokens_per_s_per_request or 0:.1f} tok/s per request "
          f"(warm-up {p.warmup_at or '-'}, measured {p.measured_at or '-'} to {p.ended_at or '-'})", flush=True)


def http_phase(ctx: Context, phase: PhaseSpec, target: TargetSpec) -> PhaseResult:
    warm_spec, spec = load_specs(ctx, phase, target)
    warmup_at = wall_clock()
    warm = run(warm_spec)
    measured_at = wall_clock()
    result = run(spec)
    return PhaseResult(name=phase.name, warmup_requests=warm.aggregate.requests, warmup_failures=warm.aggregate.failures,
                       result=result, warmup_at=warmup_at, measured_at=measured_at, ended_at=wall_clock())


def sweep_limit(ctx: Context) -> int | None:
    """The largest one-step prompt of the engines (``max_num_batched_tokens`` capped below
    ``max_model_len``, as loraplex's warm-up computes it); None when the plan sets neither."""
    from app.engine.shape_warmup import step_limit

    engine = ctx.serve_cfg["applications"][0]["args"]["engine"]
    batched, length = engine.get("max_num_batched_tokens"), engine.get("max_model_len")
    if batched is None or length is None:
        return None
    return step_limit(int(batched), int(length))


def sweep_specs(ctx: Context, target: TargetSpec) -> list[LoadSpec]:
    """The sweep's requests against ``target``: one base-model request per token-count class up
    to ``sweep_limit`` (none when the plan sets no limit), each sent alone."""
    from app.engine.shape_warmup import token_counts

    limit = sweep_limit(ctx)
    return [LoadSpec(target=target, include_base=True, input_len=n, output_len=1, temperature=0.0, concurrency=1,
                     num_requests=1, vocab_size=ctx.vocab, exclude_token_ids=ctx.special,
                     seed=zlib.crc32(f"shape-sweep-{n}".encode()), timeout_s=ctx.timeout_s)
            for n in (token_counts(limit) if limit is not None else [])]


def shape_sweep(ctx: Context, target: TargetSpec) -> ShapeSweep:
    """The sweep over HTTP, one request at a time."""
    specs = sweep_specs(ctx, target)
    if not specs:
        return ShapeSweep(error="the engine section sets no max_num_batched_tokens or max_model_len")
    t0 = time.perf_counter()
    results = [run(spec) for spec in specs]
    return sweep_record(specs, results, time.perf_counter() - t0)


def phase_ids(block: SystemBlock) -> list[str]:
    return list(dict.fromkeys(a for p in block.phases for a in adapter_ids(p.rank, p.adapters)))


def make_launcher(ctx: Context, block: SystemBlock, probe_adapters: bool = True):
    """The launcher of an HTTP system (``probe_adapters``: loraplex's start ends with a request to
    each seed adapter; off while they are still being pushed)."""
    from benchmarks.stacks.ray_llm import RayLlm
    from benchmarks.stacks.vllm_server import VllmServer

    wd = ctx.workdir / block.system
    ids = phase_ids(block)
    if block.system == "loraplex":
        seed = adapter_ids(ctx.plan.workload.rank, ctx.plan.workload.adapters)
        keys = keys_for(ctx, ids + [cold_id(ctx.plan.workload.rank, k) for k in range(block.cold_starts)])
        probe = [a for a in seed if a in ids] if probe_adapters else []
        return systems.LoraplexH200(wd, ctx.assets.home, ctx.serve_config, keys, probe=probe,
                                    env=systems.loraplex_env(ctx.assets, ctx.store.env))
    plugins, env = systems.stock_settings(ctx.assets)
    common = {"workdir": wd, "model": ctx.assets.model_dir, "engine_args": ctx.engine_args,
              "adapters": {a: ctx.adapters[a] for a in ids} or None, "served_model_name": ctx.served_name,
              "plugins": plugins, "env": env, "name": block.system}
    if block.system == "ray-llm":
        return RayLlm(**common, s3_endpoint=ctx.store.endpoint, accelerator="gpu" if ctx.assets.gpu else "cpu")
    return VllmServer(**common)


def run_server_block(ctx: Context, block: SystemBlock,
                     on_progress: Callable[[SystemRun], None] = lambda run: None) -> SystemRun:
    """System ``block`` over HTTP; ``on_progress`` gets its record after each phase and cold start."""
    out = SystemRun(system=block.system, label=LABELS[block.system], versions=ctx.host,
                    started_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    if block.system == "ray-llm" and (why := systems.ray_llm_import_error(ctx.store.env)):
        out.error = f"ray.serve.llm does not import here: {why}"
        print(f"ray-llm: {out.error}", flush=True)
        return out
    pushed = None
    if block.system == "loraplex" and ctx.push_job is not None:  # the store is filled while the engine starts
        job, ctx.push_job = ctx.push_job, None
        pool = ThreadPoolExecutor(1, thread_name_prefix="pushes")
        pushed = pool.submit(job, ctx)
        pool.shutdown(wait=False)  # a stop of the run does not wait for the pushes (the store goes, so do they)
        out.notes.append("adapters pushed while the server started: its start time includes that load on the host")
    launcher, target = start_server(ctx, block, out, probe_adapters=pushed is None)
    if target is None:
        if pushed is not None:
            pushed.result()
        return out
    try:
        if pushed is not None:
            pushed.result()  # a failed push raises here, and the server is stopped below
        out.shape_sweep = shape_sweep(ctx, target)
        for phase in block.phases:
            out.phases.append(http_phase(ctx, phase, target))
            _log_phase(block.system, out.phases[-1])
            on_progress(out)
            if phase.name in ctx.plan.cross_checked:  # vLLM's client beside ours, the same requests
                key = ctx.keys.get(OPERATOR) if target.keys else target.api_key
                ours, bench = beside(out.phases[-1].result, key, ctx.assets.model_dir,
                                     ctx.workdir / "vllm-bench" / block.system, same_key=True)
                out.cross_checks.append(CrossCheck(phase=phase.name, ours=ours, bench=bench))
                on_progress(out)
        for k in range(block.cold_starts):
            out.cold_starts.append(cold_start(ctx, target, k, Path(out.log)))
            on_progress(out)
    except Exception as exc:  # noqa: BLE001 - recorded; the next system runs
        out.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        t_stop = time.monotonic()
        launcher.stop()
        out.stop_s = time.monotonic() - t_stop
    return out


def start_server(ctx: Context, block: SystemBlock, out: SystemRun, probe_adapters: bool = True):
    """The started launcher and its target; a start that fails is tried once more (a loaded host
    can fail one: Ray's node start timing out, say), and why the first failed is recorded; after
    a second failure the target is None and ``out.error`` says why."""
    for attempt in (1, 2):
        launcher = make_launcher(ctx, block, probe_adapters)
        out.log = str(launcher.log_path)
        print(f"{block.system}: starting ...", flush=True)
        try:
            target = launcher.start()
        except Exception as exc:  # noqa: BLE001 - recorded
            why = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if attempt == 1:
                out.first_start_error = why
                continue
            out.error, target = why, None
        finally:
            if launcher.child is not None:
                out.command, out.env = systems.command_of(launcher.child), systems.path_env(launcher.child.env)
        if target is not None:
            out.start_s = launcher.ready_s
            print(f"{block.system}: ready after {launcher.ready_s:.1f} s", flush=True)
        return launcher, target
    raise AssertionError("unreachable")


def cold_start(ctx: Context, target: TargetSpec, k: int, log: Path) -> ColdStart:
    """A fresh adapter written and pushed now, then its first request and one more, timed; the
    load's steps from the server's request log ``log``."""
    rank = ctx.plan.workload.rank
    adapter = cold_id(rank, k)
    rec = ColdStart(adapter=adapter)
    root = ctx.workdir / "adapters"
    folder = write_adapters(ctx.assets, root, rank, [k], prefix=COLD_PREFIX, offset=10_000,
                            expert_lora=ctx.plan.workload.expert_lora)[adapter]
    pushed = push(ctx, folder, adapter, tenant_of(k), rank)
    ctx.pushes.append(pushed)
    shutil.rmtree(folder, ignore_errors=True)
    rec.push_s, rec.adapter_bytes = pushed.seconds, pushed.bytes
    if not pushed.ok:
        rec.error = f"push failed: {pushed.output}"
        return rec
    w = ctx.plan.workload

    def first_token(seed: int) -> LoadResult:
        return run(LoadSpec(target=target, adapters=[adapter], include_base=False, input_len=w.input_len,
                            output_len=WARMUP_TOKENS, temperature=TEMPERATURE, concurrency=1, num_requests=1,
                            vocab_size=ctx.vocab, exclude_token_ids=ctx.special, seed=seed, timeout_s=ctx.timeout_s))

    cold, warm = first_token(zlib.crc32(adapter.encode())), first_token(zlib.crc32(adapter.encode()) + 1)
    c, h = cold.records[0], warm.records[0]
    rec.cold_ttft_ms, rec.cold_e2e_ms, rec.warm_ttft_ms = c.ttft_ms, c.e2e_ms, h.ttft_ms
    if not (c.ok and h.ok):
        rec.error = (c.error or h.error or "request failed")[:500]
    steps = load_steps(log, adapter)
    if steps:
        rec.disk_load_s, rec.add_lora_s = steps.get("disk_s"), steps.get("add_lora_s")
        rec.engine_load_s = sum(steps.values())

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    print(f"loraplex cold start {adapter}: push {pushed.seconds:.1f} s, TTFT cold {c.ttft_ms} ms, "
          f"warm {h.ttft_ms} ms; the replica's load: disk {s(rec.disk_load_s)}, add_lora {s(rec.add_lora_s)}, "
          f"miss to add_lora returning {s(rec.engine_load_s)}",
          flush=True)
    return rec


def run_engine_block(ctx: Context, block: SystemBlock) -> SystemRun:
    """System (e), then its routing check (an eager engine of the same settings)."""
    out = SystemRun(system=block.system, label=LABELS[block.system], versions=ctx.host,
                    started_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    target = TargetSpec(name=block.system, base_url="in-process", base_model=ctx.served_name)
    ids = phase_ids(block)
    env = systems.loraplex_env(ctx.assets, {})
    wd = ctx.workdir / block.system
    wd.mkdir(parents=True, exist_ok=True)
    job = EngineJob(serve_config=ctx.serve_config, adapters={a: ctx.adapters[a] for a in ids},
                    shape_sweep=sweep_specs(ctx, target), phases=[JobPhase(name=p.name, warmup=w, measure=m)
                            for p in block.phases for w, m in [load_specs(ctx, p, target)]])
    print(f"{block.system}: starting ...", flush=True)
    result, child = systems.run_engine_child(wd, block.system, job, env)
    if result.start_s is None:  # the engine did not come up: once more, as a server's start
        out.first_start_error = result.error
        print(f"{block.system}: the engine did not start, once more ...", flush=True)
        result, child = systems.run_engine_child(wd, block.system, job, env)
    out.command, out.env, out.log = systems.command_of(child), systems.path_env(child.env), str(child.log_path)
    out.start_s, out.phases, out.error = result.start_s, result.phases, result.error
    out.shape_sweep = result.shape_sweep
    for p in out.phases:
        _log_phase(block.system, p)
    if block.route_check:
        out.route_check = route_check(ctx, block, target, env, wd)
    return out


def route_check(ctx: Context, block: SystemBlock, target: TargetSpec, env: dict[str, str], wd: Path):
    w = ctx.plan.workload
    ids = adapter_ids(w.rank, w.adapters)
    log = wd / "routes.jsonl"
    log.unlink(missing_ok=True)
    spec = LoadSpec(target=target, adapters=ids, include_base=False, input_len=w.input_len, output_len=ROUTE_TOKENS,
                    temperature=TEMPERATURE, concurrency=w.concurrency, num_requests=w.concurrency,
                    vocab_size=ctx.vocab, exclude_token_ids=ctx.special, seed=zlib.crc32(b"route-check"),
                    timeout_s=ctx.timeout_s)
    job = EngineJob(serve_config=ctx.serve_config, engine_update={"enforce_eager": True, "shape_warmup": False},
                    adapters={a: ctx.adapters[a] for a in ids}, phases=[JobPhase(name="route-check", measure=spec)])
    route_env = {**env, LOG_ENV: str(log), TOKENS_ENV: str(w.concurrency), FORWARDS_ENV: "256"}
    print(f"{block.system}: routing check (eager engine) ...", flush=True)
    result, _ = systems.run_engine_child(wd, "route-check", job, route_env, [plugin_site(wd / "route-plugin")])
    check = summarise(log, w.concurrency)
    if result.error and check.error:
        check.error = f"{check.error}; the engine: {result.error}"
    print(f"routing: {check.distinct_mean} distinct experts per layer per decode step of {w.concurrency} tokens "
          f"(uniform routing: {check.uniform_expectation}; min {check.distinct_min}; {check.steps} steps)"
          + (f" [{check.error}]" if check.error else ""), flush=True)
    return check


def run_plan(ctx: Context, on_system: Callable[[SystemRun, bool], None] = lambda run, done: None) -> list[SystemRun]:
    """Every block in order; ``on_system(record, done)`` gets each system's record as soon as it
    is complete (``done``) and a server's after each of its phases (not ``done``), so the caller
    can keep on disk what a run stopped at a time limit measured."""
    out = []
    for b in ctx.plan.blocks:
        out.append(run_engine_block(ctx, b) if b.system == "engine-alone"
                   else run_server_block(ctx, b, lambda run: on_system(run, False)))
        on_system(out[-1], True)
    return out
