"""Replicas needed and TTFT for many small tenants: loraplex's router, Ray Serve's default
multiplexing router, and one replica per tenant (``loraplex bench packing``).

A simulation (``benchmarks.packsim``) calibrated from one engine replica measured on this
machine (``benchmarks.packsim.measure`` wrote ``--calibration``): decode step time by batch
size, first-token and prefill time, adapter load time and the stall it causes, replica start
time; the HTTP path's overhead from ``benchmarks/RESULTS.md``. Traffic: ``--tenants`` tenants,
one adapter each, Zipf popularity, the most popular at ``--peak-tenant-load`` of a replica,
diurnal swing down to ``--diurnal-low`` of the peak. The pooled policies autoscale as Ray
Serve's default policy does (target: ``--target-fill`` of a full batch per replica), or, for
``loraplex-demand``, as loraplex's demand policy does (``app.routing.autoscaling``: the same
per-replica target, the demand's trend provisioned a replica's start ahead, ``--demand-*``); one
replica per tenant is always on.

Scenarios: ``zipf`` (exponent 0.5: a few busy tenants, a long tail), ``uniform`` (every tenant
at the peak load: Σ load large enough for the 10% criterion to mean something), and
``uniform-large-adapters`` (as ``uniform``, adapters taking ``--large-adapter-load-ms`` to
load: the 705 MiB GPT-OSS-20B adapter's cold start measured on this machine, RESULTS.md,
adapter-registry). Each reports replicas needed (replica-seconds / duration) against Σ load /
capacity and against the whole-replica floor (the time mean of ⌈Σ load⌉: no autoscaler paying
for whole replicas needs fewer), and TTFT p50/p99.

    python -m benchmarks.packing --json packing.json --plot packing.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from app.routing.autoscaling import DemandSpec
from benchmarks.packsim.autoscaler import AutoscaleSpec
from benchmarks.packsim.calibration import Calibration
from benchmarks.packsim.simulate import POLICIES, PolicyResult, simulate
from benchmarks.packsim.workload import WorkloadSpec

DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "packsim" / "calibration_cpu.json"
LARGE_ADAPTER_LOAD_MS = 1950.0  # RESULTS.md, adapter-registry, 2-vCPU VM: gpt-oss-20b cold, S3 → servable


class Scenario(BaseModel):
    name: str
    workload: WorkloadSpec
    adapter_load_ms: float | None = None


class ScenarioResult(BaseModel):
    scenario: Scenario
    results: list[PolicyResult]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    common = dict(tenants=args.tenants, peak_tenant_load=args.peak_tenant_load, diurnal_low=args.diurnal_low,
                  period_s=args.duration, duration_s=args.duration, prompt_tokens=args.prompt_tokens,
                  output_tokens=args.output_tokens, seed=args.seed)
    out = {
        "zipf": Scenario(name="zipf", workload=WorkloadSpec(zipf_s=args.zipf, **common)),
        "uniform": Scenario(name="uniform", workload=WorkloadSpec(zipf_s=0.0, **common)),
        "uniform-large-adapters": Scenario(name="uniform-large-adapters", workload=WorkloadSpec(zipf_s=0.0, **common),
                                           adapter_load_ms=args.large_adapter_load_ms),
    }
    return [out[n] for n in args.scenario]


def print_table(runs: list[ScenarioResult], cal: Calibration) -> None:
    print(f"replica capacity: {cal.capacity_tokens_per_s:.0f} output tokens/s (batch {cal.batch_capacity}, "
          f"step {cal.step(cal.batch_capacity):.1f} ms)")
    print(f"{'scenario':<24} {'policy':<15} {'replicas':>8} {'peak':>5} {'Σload':>6} {'ratio':>6} {'floor':>6} "
          f"{'÷floor':>6} {'TTFT p50':>9} {'p99':>9} {'max':>9} {'>1s':>7} {'loads':>7} {'failed':>6}")
    for run in runs:
        for r in run.results:
            t = r.ttft_ms
            print(f"{run.scenario.name:<24} {r.policy:<15} {r.mean_replicas:8.2f} {r.peak_replicas:5d} {r.mean_load:6.2f} "
                  f"{r.mean_replicas / r.mean_load:6.2f} {r.floor_replicas:6.2f} {r.mean_replicas / r.floor_replicas:6.2f} "
                  f"{t.p50 if t else float('nan'):9.1f} "
                  f"{t.p99 if t else float('nan'):9.1f} {r.ttft_max_ms or float('nan'):9.1f} {100 * r.over_1s:6.2f}% "
                  f"{r.adapter_loads:7d} {r.failed:6d}")


def write_plot(runs: list[ScenarioResult], path: Path) -> str:
    """Per scenario: replicas over time against Σ load, and TTFT p50/p99 per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed ({path} not written)"
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for (ax_r, ax_t), run in zip(axes, runs):
        first = run.results[0].series
        ax_r.plot([p.t / 60 for p in first], [p.load for p in first], "k--", label="Σ load (replicas)")
        for r in run.results:
            ax_r.step([p.t / 60 for p in r.series], [p.replicas for p in r.series], where="post", label=r.policy)
        ax_r.set_yscale("log")
        ax_r.set_xlabel("minutes")
        ax_r.set_ylabel("replicas")
        ax_r.set_title(f"{run.scenario.name}: replicas paid for")
        ax_r.legend(fontsize=8)
        names = [r.policy for r in run.results]
        x = range(len(names))
        ax_t.bar([i - 0.2 for i in x], [r.ttft_ms.p50 for r in run.results], 0.4, label="p50")
        ax_t.bar([i + 0.2 for i in x], [r.ttft_ms.p99 for r in run.results], 0.4, label="p99")
        ax_t.set_xticks(list(x), names)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT (ms)")
        ax_t.set_title(f"{run.scenario.name}: TTFT")
        ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION), help="calibration JSON (benchmarks.packsim.measure)")
    ap.add_argument("--scenario", action="append", choices=["zipf", "uniform", "uniform-large-adapters"], default=None)
    ap.add_argument("--policy", action="append", choices=POLICIES, default=None)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--zipf", type=float, default=0.5, help="Zipf exponent of the zipf scenario")
    ap.add_argument("--peak-tenant-load", type=float, default=0.09, help="the busiest tenant's peak, in replicas")
    ap.add_argument("--diurnal-low", type=float, default=0.2)
    ap.add_argument("--duration", type=float, default=21600.0, help="seconds simulated: one (compressed) day")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=512)
    ap.add_argument("--slots", type=int, default=16, help="adapters registered per replica (max_cpu_loras)")
    ap.add_argument("--max-loras", type=int, default=16, help="distinct adapters in one batch (vLLM max_loras)")
    ap.add_argument("--large-adapter-load-ms", type=float, default=LARGE_ADAPTER_LOAD_MS)
    ap.add_argument("--target-fill", type=float, default=0.9,
                    help="Serve's target_ongoing_requests as a fraction of the engine's batch capacity")
    ap.add_argument("--downscale-delay", type=float, default=120.0, help="Serve's downscale_delay_s")
    ap.add_argument("--upscale-delay", type=float, default=30.0, help="Serve's upscale_delay_s")
    ap.add_argument("--demand-smooth", type=float, default=DemandSpec().smooth_s, help="demand policy: smooth_s")
    ap.add_argument("--demand-look-back", type=float, default=DemandSpec().look_back_s, help="demand policy: look_back_s")
    ap.add_argument("--demand-lead", type=float, default=None,
                    help="demand policy: lead_s (default: the calibration's replica start time)")
    ap.add_argument("--demand-downscale-delay", type=float, default=DemandSpec().downscale_delay_s,
                    help="demand policy: downscale_delay_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    args.scenario = args.scenario or ["zipf", "uniform", "uniform-large-adapters"]
    cal = Calibration.load(args.calibration)
    autoscale = AutoscaleSpec(upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
                              max_replicas=4 * args.tenants,
                              target_ongoing_requests=args.target_fill * cal.batch_capacity)
    demand = DemandSpec(smooth_s=args.demand_smooth, look_back_s=args.demand_look_back,
                        lead_s=cal.replica_start_s if args.demand_lead is None else args.demand_lead,
                        downscale_delay_s=args.demand_downscale_delay)
    runs = []
    t0 = time.perf_counter()
    for sc in scenarios(args):
        c = cal if sc.adapter_load_ms is None else cal.model_copy(update={"adapter_load_ms": sc.adapter_load_ms})
        results = []
        for policy in args.policy or POLICIES:
            print(f"{sc.name}: {policy} ...", flush=True)
            results.append(simulate(sc.workload, c, policy, autoscale, adapter_slots=args.slots,
                                    max_loras=args.max_loras, demand=demand))
        runs.append(ScenarioResult(scenario=sc, results=results))
    print(f"calibration: {cal.source}")
    print_table(runs, cal)
    print(f"simulated in {time.perf_counter() - t0:.0f} s")
    if args.plot:
        print(write_plot(runs, Path(args.plot)))
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": cal.model_dump(), "args": vars(args),
                                               "runs": [r.model_dump() for r in runs]}, indent=1))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
