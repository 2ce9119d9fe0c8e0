"""A polite tenant's TTFT while another tenant floods, with and without fair share, on the real
stack (``loraplex bench fairness``).

Stack: the embedded default with 2 engine replicas of ``max_num_seqs`` 3 (6 batch slots, fewer
than the flood's streams) and 2 gateway replicas; vLLM's ``stream_interval`` is
``--engine-stream-interval`` for every stream (first token at once, then chunks of that many
tokens). With 1 (per-token streaming) this 2-core machine spends its time relaying the flood's
chunks through three processes, and the engine's batch is seldom what requests wait for; with
8 the engine is the bottleneck, as on a GPU host. Tenants ``flood`` and ``polite`` (weight 1).
The flood keeps ``--flood`` long streams open (``--flood-tokens`` each, ``ignore_eos``); the polite
tenant sends one short streaming request at a time (``--probe-tokens``), ``--pause`` apart.

Phases, in this order, all in one run:

1. ``alone``: probes with no flood (fair share on);
2. ``flood, fair share``: the flood alone for ``--window`` seconds (its tokens/s), then probes
   while it runs (its tokens/s during them);
3. the same with fair share off (the tenants file's ``fair_share: false``: first come, first
   served everywhere), the flood restarted so no stream carries the other mode's priority;
4. ``alone, again``: probes with no flood, to see drift of the machine over the run.

Reported per phase: probe TTFT p50/p90/p99 and failures, the flood's output tokens/s (chunks
received: one token each on this stack), and which gateway replicas answered.

    python -m benchmarks.fairness --json fairness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
from pydantic import BaseModel, Field

from benchmarks.loadgen.contention import Flood, ProbeRecord, probe
from benchmarks.loadgen.spec import Percentiles
from benchmarks.loadgen.stats import summarise

STACK_ARGS = {  # the serve config's args (merged into deploy/config.yaml's)
    "topology": "split",
    "engine": {"max_num_seqs": 3},
    "engine_deployment": {"num_replicas": 2},
    "gateway_deployment": {"num_replicas": 2},
}
TENANTS = ("flood", "polite")


def stack_args(engine_stream_interval: int) -> dict:
    """``STACK_ARGS`` with vLLM's stream interval for every stream."""
    engine = {**STACK_ARGS["engine"], "extra_engine_args": {"stream_interval": engine_stream_interval}}
    return {**STACK_ARGS, "engine": engine}


class FairnessSpec(BaseModel):
    """The workload."""

    flood_streams: int = Field(8, description="Concurrent streams of the flooding tenant.")
    flood_tokens: int = Field(1000, description="Output tokens of each flood stream.")
    probes: int = Field(30, description="Polite requests per phase with fair share (and alone).")
    fcfs_probes: int = Field(15, description="Polite requests in the phase without fair share (each waits long).")
    probe_tokens: int = Field(4, description="Output tokens of each polite request.")
    pause_s: float = Field(0.2, description="Pause between two polite requests.")
    window_s: float = Field(8.0, description="Seconds the flood's rate is measured alone before the probes.")
    engine_stream_interval: int = Field(8, description="vLLM's stream_interval for every stream of the stack.")


class PhaseResult(BaseModel):
    """One phase."""

    name: str
    fair_share: bool
    flooded: bool
    ttft_ms: Percentiles | None = Field(None, description="Probe TTFT over the successful probes.")
    probes: int = 0
    probe_failures: int = 0
    flood_alone_tokens_per_s: float | None = Field(None, description="The flood's output tokens/s before the probes.")
    flood_tokens_per_s: float | None = Field(None, description="The flood's output tokens/s while the probes ran.")
    flood_streams_done: int = Field(0, description="Flood streams completed in the phase.")
    gateways: dict[str, int] = Field(default_factory=dict, description="Gateway replica → answers (probes and flood).")
    ttfts_ms: list[float] = Field(default_factory=list, description="Every successful probe's TTFT.")


class FairnessReport(BaseModel):
    date: str
    cpus: int | None
    client_realtime: bool
    spec: FairnessSpec
    phases: list[PhaseResult]


def set_fair_share(tenants_file: Path, on: bool) -> None:
    """The tenants file's ``fair_share`` switch (gateways reload the file at their next request)."""
    from app.gateway.tenants import TenantsFile

    doc = TenantsFile.read(tenants_file)
    doc.fair_share = on
    doc.write(tenants_file)


def add_tenants(tenants_file: Path) -> dict[str, str]:
    """Keys of fresh tenants ``flood`` and ``polite``."""
    from app.gateway.tenants import TenantsFile

    doc = TenantsFile.read(tenants_file)
    keys = {name: doc.add_key(name, max_concurrency=64) for name in TENANTS}
    doc.write(tenants_file)
    return keys


def _phase(name: str, fair: bool, flooded: bool, probes: list[ProbeRecord]) -> PhaseResult:
    ok = [p.record.ttft_ms for p in probes if p.record.ok and p.record.ttft_ms is not None]
    return PhaseResult(name=name, fair_share=fair, flooded=flooded, ttft_ms=summarise(ok), probes=len(probes),
                       probe_failures=len(probes) - len(ok), ttfts_ms=ok,
                       gateways=dict(Counter(p.gateway for p in probes if p.gateway)))


async def flooded_phase(client: httpx.AsyncClient, keys: dict[str, str], spec: FairnessSpec, fair: bool,
                        n_probes: int) -> PhaseResult:
    flood_body = {"model": "loraplex-base", "prompt": "flood", "max_tokens": spec.flood_tokens,
                  "ignore_eos": True, "temperature": 0}
    probe_body = {"model": "loraplex-base", "prompt": "hello", "max_tokens": spec.probe_tokens, "temperature": 0}
    flood = Flood(client, keys["flood"], flood_body, spec.flood_streams).start()
    try:
        await flood.wait_streaming()
        t0, n0 = time.monotonic(), flood.tokens
        await asyncio.sleep(spec.window_s)
        alone_rate = (flood.tokens - n0) / (time.monotonic() - t0)
        t1, n1 = time.monotonic(), flood.tokens
        probes = await probe(client, keys["polite"], probe_body, n_probes, spec.pause_s)
        rate = (flood.tokens - n1) / (time.monotonic() - t1)
    finally:
        await flood.stop()
    result = _phase(f"flood, fair share {'on' if fair else 'off'}", fair, True, probes)
    result.flood_alone_tokens_per_s, result.flood_tokens_per_s = alone_rate, rate
    result.flood_streams_done = flood.streams_done
    result.gateways = dict(Counter(result.gateways) + Counter({g: n for g, n in flood.gateways.items() if g}))
    return result


async def run_phases(base_url: str, keys: dict[str, str], tenants_file: Path, spec: FairnessSpec,
                     log=print) -> list[PhaseResult]:
    """The phases of the module doc, against a running stack."""
    probe_body = {"model": "loraplex-base", "prompt": "hello", "max_tokens": spec.probe_tokens, "temperature": 0}
    limits = httpx.Limits(max_connections=spec.flood_streams + 4, max_keepalive_connections=spec.flood_streams + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(600, connect=30)) as client:
        set_fair_share(tenants_file, True)
        await probe(client, keys["polite"], probe_body, 3, spec.pause_s)  # warm-up, not counted
        log("phase: alone")
        phases = [_phase("alone", True, False, await probe(client, keys["polite"], probe_body, spec.probes, spec.pause_s))]
        log("phase: flood, fair share on")
        phases.append(await flooded_phase(client, keys, spec, True, spec.probes))
        set_fair_share(tenants_file, False)
        log("phase: flood, fair share off")
        phases.append(await flooded_phase(client, keys, spec, False, spec.fcfs_probes))
        set_fair_share(tenants_file, True)
        log("phase: alone, again")
        phases.append(_phase("alone, again", True, False,
                             await probe(client, keys["polite"], probe_body, spec.probes, spec.pause_s)))
    return phases


@contextmanager
def client_priority():
    """SCHED_FIFO for this thread while measuring, when allowed (a normal-priority client on 2 cores
    sees chunks late); restored after. Yields whether it is real-time."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, AttributeError, OSError):
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def print_table(phases: list[PhaseResult]) -> None:
    print(f"{'phase':<26} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'fail':>5} {'flood tok/s alone':>18} "
          f"{'flood tok/s w/ probes':>22}  gateways")
    for p in phases:
        t = p.ttft_ms
        cells = [f"{v:9.1f}" for v in (t.p50, t.p90, t.p99)] if t else ["        -"] * 3
        rate = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
        print(f"{p.name:<26} {' '.join(cells)} {p.probe_failures:>5} {rate(p.flood_alone_tokens_per_s):>18} "
              f"{rate(p.flood_tokens_per_s):>22}  {len(p.gateways)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, field in FairnessSpec.model_fields.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(field.default), default=field.default,
                        help=field.description)
    ap.add_argument("--workdir", default=None, help="stack logs and its LORAPLEX_HOME (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    spec = FairnessSpec(**{k: getattr(args, k) for k in FairnessSpec.model_fields})
    from app.embedded.setup import init
    from tests.helpers.stack import start_stack, stop_stack

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-fairness-"))
    home = init(workdir / "home", progress=False)
    keys = add_tenants(home / "tenants.yaml")
    print("starting the stack (2 engine replicas, 2 gateway replicas) ...", flush=True)
    stack = start_stack(home, workdir, args_update=stack_args(spec.engine_stream_interval))
    try:
        with client_priority() as realtime:
            phases = asyncio.run(run_phases(stack.base_url, keys, home / "tenants.yaml", spec))
    finally:
        stop_stack(stack)
    report = FairnessReport(date=time.strftime("%Y-%m-%d %H:%M:%S"), cpus=os.cpu_count(), client_realtime=realtime,
                            spec=spec, phases=phases)
    print(f"client priority: {'SCHED_FIFO' if realtime else 'normal'}")
    print_table(phases)
    if args.json:
        Path(args.json).write_text(json.dumps(report.model_dump(), indent=1))
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
