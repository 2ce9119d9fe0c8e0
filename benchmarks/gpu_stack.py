"""The whole stack comparison in one command: stock vLLM without and with LoRA, ray.serve.llm,
loraplex through its real serving path, and loraplex's engine alone, side by side in one run.

Systems (each started once, its phases back to back, stopped before the next starts):
 (a) ``vllm-base``: vLLM's own OpenAI server without LoRA;
 (b) ``vllm-lora``: the same with the adapters (``--lora-modules``), loraplex's kernels off;
 (c) ``ray-llm``: ray.serve.llm's ``build_openai_app`` with a ``LoraConfig`` on the local S3
     (attempted; where it does not import, the error is recorded and the others run);
 (d) ``loraplex``: ``loraplex serve`` of deploy/h200.yaml with only this host's needs changed
     (``benchmarks.gpu_stack_parts.serve_config``), tenants reaching the engine through the
     gateway, the adapter-affinity router and an engine replica pulling adapters from S3;
 (e) ``engine-alone``: loraplex's engine (the same engine section, its plugin on) driven in
     process with exactly the same workload (``benchmarks.loadgen.engine_target``).
Every system gets the engine arguments of loraplex's engine section. Adapters are pushed to a
local moto S3 server with ``loraplex adapters push`` (each push timed); the stock servers and the
engine alone read the same files from their folders.

Extra measurements on loraplex: the working set larger than its slots (round-robin and Zipf),
and cold starts (a fresh adapter pushed while it runs, then the TTFT of its first request and of
the next); on the engine alone, the routing check (distinct experts per MoE layer per decode
step, hooks on the routers of an eager engine of the same settings). With ``--vllm-bench
PHASE,...``, vLLM's own client runs each named phase's workload against every HTTP system right
after ours, both sending the same requests: a cross-check of the load generator.

Output (``--out``, default the work folder): ``gpu_stack.json`` (every record, the commands,
versions, start times), ``gpu_stack_table.md`` (the tables, as printed) and ``gpu_stack.png``
(TTFT p50 and output tokens/s per request by concurrency, one line per system). The plan and
its estimate are printed first (``--dry-run``: only that).

On the GPU host (``scripts/gpu_stack.sh`` sets the environment up and runs this):
    python3 -m benchmarks.gpu_stack [--plan default|full] [--model gptoss-mxfp4|gptoss]
On any machine, the CPU stack at tiny settings:
    python -m benchmarks.gpu_stack --model embedded --plan tiny
Part of a plan (``--phases``, ``--cold-starts``), e.g. 64 adapters over the slots, with the store
filled by an earlier command (44 GiB of pushes take longer than a server's start) into an S3
server started in its own session so that it outlives that command:
    python3 -m benchmarks.gpu_stack --plan full --systems loraplex --phases ws64-round-robin \
        --s3-endpoint http://127.0.0.1:PORT --pushes-only        (then the same without --pushes-only)
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file: the checkout's packages by their full names
    sys.path.insert(0, str(REPO))

from app.config import TOPOLOGIES
from benchmarks.gpu_stack_parts.assets import (
    MODELS,
    prepare_model,
    write_adapters,
    write_tenants,
)
from benchmarks.gpu_stack_parts.host import gpu_processes, host_info
from benchmarks.gpu_stack_parts.models import StackReport
from benchmarks.gpu_stack_parts.output import write_outputs
from benchmarks.gpu_stack_parts.plan import (
    PLANS,
    SYSTEMS,
    Plan,
    adapter_id,
    build_plan,
    estimate,
    format_plan,
    rebuild_plan,
    resources,
    tenant_of,
)
from benchmarks.gpu_stack_parts.pushes import local_s3, published, push, running_s3
from benchmarks.gpu_stack_parts.runner import Context, run_plan
from benchmarks.gpu_stack_parts.serve_config import (
    host_config,
    stock_engine_args,
    write_yaml,
)
from benchmarks.stacks.engine_settings import apply_engine_settings, engine_setting
from benchmarks.stacks.host_memory import available_bytes

PUSH_WORKERS = 6  # adapters written and pushed at once while loraplex starts (a cold start's runs alone)
CACHE_SHARE_OF_FREE_DISK = 0.8
HOST_LORA_SHARE_OF_AVAILABLE = 0.5  # of MemAvailable: the registered adapters' budget on this host
INCOMPLETE = "incomplete: the run was stopped before this system's last phase (these phases were measured)"


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated batch sizes, e.g. 1,2,4,8,16") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one batch size, each >= 1")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODELS[0], choices=MODELS,
                    help="GPT-OSS-20B shape with random weights (MXFP4 experts as released, or bf16), or the embedded CPU model")
    ap.add_argument("--plan", default=None, choices=PLANS, help="default: 'default' on a GPU model, 'tiny' on embedded")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--phases", default=None, metavar="NAME,...",
                    help="only these phases of the plan (e.g. ws64-round-robin,ws64-zipf of the full plan); a system "
                         "left without phases or cold starts is not started")
    ap.add_argument("--cold-starts", type=int, default=None, metavar="N",
                    help="loraplex's cold starts instead of the plan's (1 in default, 3 in full)")
    ap.add_argument("--workdir", default=None, help="model, adapters, configs, logs (default: a new temporary folder)")
    ap.add_argument("--out", default=None, help="where the JSON, the tables and the plot go (default: the work folder)")
    ap.add_argument("--s3-in-memory", action="store_true", help="the S3 server keeps objects in memory, not on disk")
    ap.add_argument("--s3-endpoint", default=None, metavar="URL",
                    help="an S3 server already running (e.g. moto started by an earlier command in its own session): "
                         "adapters it holds are not pushed again, and it is left running")
    ap.add_argument("--pushes-only", action="store_true",
                    help="write and push loraplex's adapters into --s3-endpoint's store, then stop (no system runs): "
                         "a later command with the same endpoint starts its systems on a filled store")
    ap.add_argument("--cache-gib", type=float, default=None,
                    help=f"loraplex's disk cache bound (default: {CACHE_SHARE_OF_FREE_DISK} of the free disk, less the "
                         "store's temporary files)")
    ap.add_argument("--timeout", type=float, default=900.0, help="read timeout of one request, seconds")
    ap.add_argument("--merge", type=Path, default=None,
                    help="gpu_stack.json (or gpu_stack.partial.json: a run stopped midway) of an earlier run on this host (same plan and model, other systems): its "
                         "systems and pushes join this run's tables, JSON and plot, in the plan's order")
    ap.add_argument("--cudagraph-capture-sizes", type=_sizes, default=None, metavar="N,N,...",
                    help="vLLM's CUDA graph batch sizes for every system (default: vLLM's, 35 sizes up to 2x "
                         "max_num_seqs; fewer sizes start each engine faster, the same on every system)")
    ap.add_argument("--engine-set", action="append", default=[], type=engine_setting, metavar="KEY=VALUE",
                    help="an engine setting for every system (repeatable; VALUE read as YAML): a field of loraplex's "
                    "engine section (app.config.EngineConfig, e.g. max_lora_rank=32) or else a vLLM engine argument "
                    "(extra_engine_args, e.g. enable_prefix_caching=false)")
    ap.add_argument("--loraplex-topology", default=None, choices=TOPOLOGIES,
                    help="loraplex's `topology` (default: deploy/h200.yaml's, split; colocated: gateway and "
                    "engine in one replica, app.colocated)")
    ap.add_argument("--no-routing-check", action="store_true",
                    help="skip the engine alone's routing check (the same weights give the same routing: "
                         "an earlier run on this model measured it)")
    ap.add_argument("--staggered-starts", action="store_true",
                    help="each measured phase's workers start spread over one request (worker k once the first "
                         "request has produced k/concurrency of its tokens) instead of together, so prompts arrive "
                         "spread, not in synchronized waves whose shape decides TTFT (benchmarks.loadgen.closed_loop)")
    ap.add_argument("--vllm-bench", default=None, metavar="NAME,...",
                    help="after these phases, on every HTTP system, vLLM's own client (vllm bench serve) runs the "
                         "phase's workload against the same endpoint beside ours, both sending the same requests "
                         "(benchmarks.loadgen.vllm_bench.beside): a cross-check of the load generator")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimate only")
    return ap


def write_local_adapters(ctx: Context) -> None:
    """The folders the stock servers and the engine alone read (ray.serve.llm's launcher uploads
    them itself); adapters only loraplex reads are written by ``push_adapters``."""
    local = ctx.plan.families(("vllm-lora", "ray-llm", "engine-alone"))
    for rank, count in sorted(local.items()):
        ctx.adapters.update(write_adapters(ctx.assets, ctx.workdir / "adapters", rank, list(range(count)),
                                           expert_lora=ctx.plan.workload.expert_lora))


def push_adapters(ctx: Context) -> None:
    """Every adapter loraplex addresses pushed with ``loraplex adapters push``, ``PUSH_WORKERS`` at
    a time, each written first where its folder is not there yet (folders no other system reads
    are removed once pushed: only the store keeps them, so the disk holds a few at a time).
    Raises SystemExit on the first failed push; the pushes not started by then are not."""
    t0 = time.perf_counter()
    local = ctx.plan.families(("vllm-lora", "ray-llm", "engine-alone"))
    families = sorted(ctx.plan.families(("loraplex",)).items())
    for rank, _ in families:  # the templates, before the adapters are written from them at once
        write_adapters(ctx.assets, ctx.workdir / "adapters", rank, [], expert_lora=ctx.plan.workload.expert_lora)
    held = published(ctx.store)  # an S3 server kept from an earlier command holds these already
    jobs = [(rank, i) for rank, count in families for i in range(count) if adapter_id(rank, i) not in held]
    if held:
        print(f"{len(held)} adapters already in the store: not pushed again", flush=True)

    def one(rank: int, i: int):
        folder = next(iter(write_adapters(ctx.assets, ctx.workdir / "adapters", rank, [i],
                                          expert_lora=ctx.plan.workload.expert_lora).values()))
        rec = push(ctx, folder, folder.name, tenant_of(i), rank)
        if rec.ok and i >= local.get(rank, 0):
            shutil.rmtree(folder, ignore_errors=True)
        return rec

    with ThreadPoolExecutor(PUSH_WORKERS if ctx.assets.gpu else 1, thread_name_prefix="push") as pool:
        futures = [pool.submit(one, rank, i) for rank, i in jobs]
        try:
            for fut in futures:
                rec = fut.result()
                ctx.pushes.append(rec)
                print(f"push {rec.adapter} ({rec.tenant}): {'ok' if rec.ok else 'FAILED'} in {rec.seconds:.1f} s"
                      + ("" if rec.ok else f": {rec.output}"), flush=True)
                if not rec.ok:
                    raise SystemExit(f"loraplex adapters push failed for {rec.adapter}: {rec.output}")
        finally:
            for fut in futures:
                fut.cancel()
    print(f"adapters written and pushed in {time.perf_counter() - t0:.0f} s", flush=True)


def merge_reports(earlier: StackReport, later: StackReport, plan_name: str | None, model: str) -> tuple[StackReport, Plan]:
    """One report of two runs of the same plan and model on one host: the systems of both in
    the plan's order (``later``'s where both ran one), both runs' pushes, commands and wall times."""
    if earlier.plan.get("name") != later.plan.get("name") or earlier.plan.get("model") != later.plan.get("model"):
        raise SystemExit(f"--merge: the earlier run is plan {earlier.plan.get('name')!r} on {earlier.plan.get('model')!r}, "
                         f"this one {later.plan.get('name')!r} on {later.plan.get('model')!r}")
    starts = {p.result.spec.staggered_starts for r in (earlier, later) for s in r.systems for p in s.phases}
    if len(starts) > 1:
        raise SystemExit("--merge: one run started its workers staggered and the other together: not comparable")
    runs = {s.system: s for s in earlier.systems} | {s.system: s for s in later.systems}
    systems = tuple(s for s in SYSTEMS if s in runs)
    selection = ("selected_phases", "cold_start_count")
    if any(earlier.plan.get(k) != later.plan.get(k) for k in selection):
        raise SystemExit("--merge: the two runs selected other phases or cold starts (--phases, --cold-starts)")
    plan = rebuild_plan(later.plan if plan_name is None else {**later.plan, "name": plan_name}, systems)
    merged = later.model_copy(update={
        "date": f"{earlier.date} and {later.date}", "command": f"{earlier.command} ; then {later.command}",
        "plan": plan.model_dump(), "estimate_s": earlier.estimate_s + later.estimate_s,
        "wall_s": earlier.wall_s + later.wall_s, "engine": later.engine or earlier.engine,
        "pushes": earlier.pushes + later.pushes, "systems": [runs[s] for s in systems],
        "notes": [*earlier.notes, *later.notes, f"merged from two runs on this host: {', '.join(x.system for x in earlier.systems)}"
                  f" at {earlier.date}, then {', '.join(x.system for x in later.systems)} at {later.date}"]})
    return merged, plan


def _stop_on_sigterm(signum, frame) -> None:
    from benchmarks.stacks.process import hurry

    hurry()  # whoever sent this SIGKILLs soon: the servers and engines must be gone before
    raise SystemExit(128 + signum)  # unwinds the launchers and the S3 server: nothing is left running


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    systems = tuple(s for s in args.systems.split(",") if s)
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise SystemExit(f"unknown systems {unknown}; choose among {','.join(SYSTEMS)}")
    try:
        plan = build_plan(args.plan or ("tiny" if args.model == "embedded" else "default"), args.model, systems,
                          route_check=not args.no_routing_check,
                          phases=[p for p in args.phases.split(",") if p] if args.phases else None,
                          cold_starts=args.cold_starts,
                          cross_checked=[p for p in (args.vllm_bench or "").split(",") if p])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return 0
    t0 = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-gpu-stack-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    report = StackReport(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command=shlex.join([sys.executable, *sys.argv]),
                         plan=plan.model_dump(), estimate_s=sum(s for _, s in estimate(plan)), host=host_info())
    print(f"host: {report.host}; work folder {workdir}", flush=True)
    out_dir = Path(args.out).resolve() if args.out else workdir
    out_dir.mkdir(parents=True, exist_ok=True)
    if busy := gpu_processes():
        raise SystemExit("the GPU is in use before the run (an earlier run's server or engine left behind?): "
                         + "; ".join(busy) + ". Stop those processes first: every system needs the whole GPU.")
    assets = prepare_model(args.model, workdir)
    tenants = workdir / "tenants.yaml"
    keys = write_tenants(tenants)
    from benchmarks.loadgen.client import raise_priority
    from benchmarks.loadgen.workload import model_vocab

    vocab, special = model_vocab(assets.model_dir)
    if args.pushes_only and not args.s3_endpoint:
        raise SystemExit("--pushes-only fills the store of --s3-endpoint (a server that outlives this command)")
    store_cm = running_s3(args.s3_endpoint) if args.s3_endpoint else local_s3(workdir, args.s3_in_memory)
    with store_cm as store:
        cfg = host_config(assets, workdir, store.uri, store.endpoint, tenants, None)
        ctx = Context(plan=plan, workdir=workdir, assets=assets, serve_config=workdir / "loraplex-h200.yaml",
                      serve_cfg=cfg, engine_args={}, store=store, keys=keys, adapters={}, vocab=vocab,
                      special=special, host=report.host, timeout_s=args.timeout,
                      staggered_starts=args.staggered_starts)
        try:
            write_local_adapters(ctx)
            # loraplex's pushes run while its engine starts (runner.run_server_block): what they will
            # take of the disk (moto's temporary files) is left out of its cache, or of the memory
            # (an in-memory store) out of its adapters' budget; a kept store is filled already
            store_bytes = 0 if args.s3_endpoint else int(resources(plan).get("store", 0) * 2**30)
            free = shutil.disk_usage(workdir).free - (0 if args.s3_in_memory else store_bytes)
            cache = int(args.cache_gib * 2**30) if args.cache_gib else max(int(free * CACHE_SHARE_OF_FREE_DISK), 0)
            # registered adapters are page-locked host copies: bounded to a share of what the host
            # has left once an in-memory store is filled
            in_memory_store = store_bytes if args.s3_in_memory else 0
            host_lora = (None if (avail := available_bytes()) is None
                         else max(int((avail - in_memory_store) * HOST_LORA_SHARE_OF_AVAILABLE), 2**30))
            ctx.serve_cfg = host_config(assets, workdir, store.uri, store.endpoint, tenants, cache,
                                        host_lora_max_bytes=host_lora)
            if args.pushes_only:
                push_adapters(ctx)
                return 0
            engine = ctx.serve_cfg["applications"][0]["args"]["engine"]
            report.notes.append(f"max_cpu_lora_gib here: {engine.get('max_cpu_lora_gib')} (at most "
                                f"{HOST_LORA_SHARE_OF_AVAILABLE} of the host memory available at the start)")
            if args.cudagraph_capture_sizes:
                engine.setdefault("extra_engine_args", {})["cudagraph_capture_sizes"] = args.cudagraph_capture_sizes
            if args.engine_set:
                apply_engine_settings(engine, args.engine_set)
                report.notes.append("engine settings of every system: " + ", ".join(f"{k}={v}" for k, v in args.engine_set))
            if args.staggered_starts:
                report.notes.append("measured phases: workers started staggered over one request")
            if plan.cross_checked:
                report.notes.append(f"vllm bench serve beside the load generator after {', '.join(plan.cross_checked)}")
            if args.loraplex_topology:
                ctx.serve_cfg["applications"][0]["args"]["topology"] = args.loraplex_topology
                report.notes.append(f"loraplex topology: {args.loraplex_topology}")
            ctx.push_job = push_adapters  # run by loraplex's block, while its stack starts
            write_yaml(ctx.serve_cfg, ctx.serve_config)
            ctx.engine_args = report.engine = stock_engine_args(ctx.serve_cfg)
            print(f"engine arguments of every system: {ctx.engine_args}", flush=True)
            fifo = raise_priority()  # the servers are started at the normal policy by their launchers
            report.notes.append(f"load generator priority: {'SCHED_FIFO' if fifo else 'normal'}")
            partial = out_dir / "gpu_stack.partial.json"

            def keep(run, done: bool) -> None:  # what was measured survives a stop at the time limit
                if done:
                    report.systems.append(run)
                report.pushes, report.wall_s = ctx.pushes, time.perf_counter() - t0
                kept = report if done else report.model_copy(update={"systems": [*report.systems, run.model_copy(
                    update={"notes": [*run.notes, INCOMPLETE]})]})
                partial.write_text(kept.model_dump_json(indent=1))

            run_plan(ctx, keep)
            partial.unlink(missing_ok=True)
        finally:
            report.pushes = ctx.pushes
    report.wall_s = time.perf_counter() - t0
    if args.merge:
        report, plan = merge_reports(StackReport.model_validate_json(args.merge.read_text()), report, args.plan, args.model)
    print(write_outputs(report, plan, out_dir))
    print(f"wall time {report.wall_s / 60:.1f} min (estimate {report.estimate_s / 60:.1f} min)")
    failed = [s.system for s in report.systems if s.system != "ray-llm"
              and (s.error or any(p.result.aggregate.failures for p in s.phases))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
