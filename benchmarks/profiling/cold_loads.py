"""Cold adapter loads through the replica's own load path, one pinning mode against another in
one engine: what ``engine.adapter_pinning`` costs a cold request and the streams already running.

    python3 -m benchmarks.profiling.cold_loads SERVE_CONFIG --adapter DIR [--reps 3]
        [--modes eager,deferred,pooled] [--region-gib 4] [--streams 8] [--json OUT]

Starts SERVE_CONFIG's engine in process (``engine_from_config`` and the replica's shape warm-up,
as the engine alone of ``benchmarks.gpu_stack``), keeps ``--streams`` base-model streams decoding
(restarted as they end), then for each rep, each mode in turn: DIR registered under a fresh name
and id through the replica's load path (``app.engine.vllm_serving.ServingLoraOps.add_lora``: the
preparation in a worker thread, then ``add_lora``) with that pinning mode, then one request of
``--prompt-len`` tokens on it (its TTFT: the cold request's, its adapter just registered), then the
same request again (warm). ``--region-gib`` reserves the page-locked region ``pooled`` copies into
(``kernels.vllm.pinned_region``) after the warm-up. Recorded per load: ``add_lora`` seconds, cold and warm TTFT, and the
background streams' inter-token gaps from the load's start to the cold request's first token
(median and worst). ``--settle`` seconds pass before the next load (a deferred pinning ends).
On a CPU engine pinning is a no-op: both modes take the same path.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
import types
import uuid
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

FIRST_ID = 1000  # lora_int_ids of the loads: clear of any the engine's warm-up used


class Load(BaseModel):
    """One cold load and its requests."""

    mode: str = Field(description="engine.adapter_pinning of this load: eager, deferred or pooled.")
    rep: int
    add_lora_s: float = Field(description="ServingLoraOps.add_lora: preparation and add_lora.")
    cold_ttft_ms: float = Field(description="TTFT of the first request on the adapter, sent once add_lora returned.")
    warm_ttft_ms: float = Field(description="TTFT of the same request sent again.")
    gap_p50_ms: float = Field(description="Median inter-token gap of the background streams during the load.")
    gap_max_ms: float = Field(description="Worst inter-token gap of the background streams during the load.")
    gaps: int = Field(description="Gaps seen in the window.")


class ColdLoadsReport(BaseModel):
    adapter: str
    streams: int
    prompt_len: int
    loads: list[Load] = Field(default_factory=list)
    steady_gap_p50_ms: float = Field(0.0, description="Median gap of the streams before any load.")
    region_bytes: int = Field(0, description="The pinned region reserved (0: none).")
    region_s: float = Field(0.0, description="Seconds its reservation took.")


def window_gaps(arrivals: list[tuple[float, int]], start: float, end: float) -> list[float]:
    """Inter-token gaps (s) of each stream between consecutive outputs that both arrived in
    ``[start, end]``, plus the gap that spans ``start`` (a stream stalled across the window's
    start); ``arrivals``: ``(time, stream)`` in arrival order."""
    last: dict[int, float] = {}
    gaps = []
    for t, stream in arrivals:
        if t > end:
            break
        prev = last.get(stream)
        if prev is not None and t >= start:
            gaps.append(t - prev)
        last[stream] = t
    return gaps


class Background:
    """``n`` base-model streams decoding until stopped; every output's ``(time, stream)``."""

    def __init__(self, engine: Any, n: int, vocab: int, prompt_len: int = 64, output_len: int = 4096) -> None:
        self.engine, self.n, self.vocab = engine, n, vocab
        self.prompt_len, self.output_len = prompt_len, output_len
        self.arrivals: list[tuple[float, int]] = []
        self._tasks: list[asyncio.Task] = []
        self._rng = random.Random(7)

    async def _stream(self, k: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=self.output_len, ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.DELTA)
        while True:
            ids = [self._rng.randrange(self.vocab) for _ in range(self.prompt_len)]
            async for _ in self.engine.generate({"prompt_token_ids": ids}, params, f"bg-{k}-{uuid.uuid4().hex[:8]}"):
                self.arrivals.append((time.perf_counter(), k))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._stream(k)) for k in range(self.n)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def ttft_ms(engine: Any, ids: list[int], lora: Any) -> float:
    from app.engine.vllm_serving import one_greedy_token

    t0 = time.perf_counter()
    first = None
    async for _ in engine.generate({"prompt_token_ids": ids}, one_greedy_token(), f"cold-{uuid.uuid4().hex[:12]}",
                                   lora_request=lora):
        first = first if first is not None else time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1e3


async def run(serve_config: Path, adapter: Path, modes: list[str], reps: int, streams: int, prompt_len: int,
              settle_s: float, region_gib: float = 0.0) -> ColdLoadsReport:
    from vllm.lora.request import LoRARequest

    from app.engine import shape_warmup
    from app.engine.vllm_serving import ServingLoraOps, engine_limits
    from benchmarks.gpu_stack_parts.serve_config import engine_config
    from benchmarks.loadgen.engine_target import engine_from_config

    cfg = engine_config(yaml.safe_load(serve_config.read_text()))
    engine = engine_from_config(cfg)
    report = ColdLoadsReport(adapter=adapter.name, streams=streams, prompt_len=prompt_len)
    try:
        await shape_warmup.run(engine, cfg.seed)
        if region_gib > 0:
            from kernels.vllm.worker_extension import RESERVE_PINNED

            size, seconds = (await engine.collective_rpc(RESERVE_PINNED, args=(int(region_gib * 2**30),)))[0]
            report.region_bytes, report.region_s = int(size), round(seconds, 3)
        vocab = min(engine_limits(engine).vocab_size, shape_warmup.PROMPT_ID_RANGE)
        serving = types.SimpleNamespace(engine=engine, models=types.SimpleNamespace(lora_requests={}))
        ops = {m: ServingLoraOps(serving, cfg.adapter_load_threads, m) for m in modes}
        rng = random.Random(3)
        background = Background(engine, streams, vocab)
        background.start()
        try:
            await asyncio.sleep(settle_s)
            steady = window_gaps(background.arrivals, 0.0, time.perf_counter())
            report.steady_gap_p50_ms = round(statistics.median(steady) * 1e3, 2) if steady else 0.0
            ids = itertools.count(FIRST_ID)
            for rep in range(reps):
                for mode in modes:
                    n = next(ids)
                    lora = LoRARequest(f"cold-{mode}-{rep}", n, str(adapter))
                    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
                    t0 = time.perf_counter()
                    await ops[mode].add_lora(lora)
                    added = time.perf_counter() - t0
                    cold = await ttft_ms(engine, prompt, lora)
                    t_first = t0 + added + cold / 1e3
                    warm = await ttft_ms(engine, prompt, lora)
                    gaps = window_gaps(background.arrivals, t0, t_first)
                    report.loads.append(Load(
                        mode=mode, rep=rep, add_lora_s=round(added, 4), cold_ttft_ms=round(cold, 2),
                        warm_ttft_ms=round(warm, 2),
                        gap_p50_ms=round(statistics.median(gaps) * 1e3, 2) if gaps else 0.0,
                        gap_max_ms=round(max(gaps) * 1e3, 2) if gaps else 0.0, gaps=len(gaps)))
                    last = report.loads[-1]
                    print(f"{mode:>9} rep {rep}: add_lora {last.add_lora_s:.3f} s, TTFT cold {last.cold_ttft_ms:.1f} / "
                          f"warm {last.warm_ttft_ms:.1f} ms; other streams' gaps p50 {last.gap_p50_ms:.1f} / "
                          f"worst {last.gap_max_ms:.1f} ms ({last.gaps})", flush=True)
                    await asyncio.sleep(settle_s)
        finally:
            await background.stop()
        return report
    finally:
        engine.shutdown()


def summary(report: ColdLoadsReport) -> str:
    """Median per mode over the reps."""
    region = (f"; pinned region {report.region_bytes / 2**30:.1f} GiB reserved in {report.region_s} s"
              if report.region_bytes else "")
    lines = [f"{report.adapter}: {report.streams} background streams (steady gap p50 {report.steady_gap_p50_ms} ms), "
             f"{report.prompt_len}-token cold requests; median over reps{region}",
             "| pinning | loads | add_lora s | cold TTFT ms | warm TTFT ms | streams' gap p50 ms "
             "| streams' worst gap ms |",
             "|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(x.mode for x in report.loads):
        rows = [x for x in report.loads if x.mode == mode]

        def med(field: str) -> float:
            return statistics.median(getattr(x, field) for x in rows)

        lines.append(f"| {mode} | {len(rows)} | {med('add_lora_s'):.3f} | {med('cold_ttft_ms'):.1f} | "
                     f"{med('warm_ttft_ms'):.1f} | {med('gap_p50_ms'):.1f} | {med('gap_max_ms'):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("serve_config", type=Path, help="a Serve config whose first application is loraplex")
    ap.add_argument("--adapter", type=Path, required=True, help="one PEFT adapter folder, loaded under fresh names")
    ap.add_argument("--modes", default="eager,deferred", help="pinning modes, comma-separated, alternated per rep")
    ap.add_argument("--region-gib", type=float, default=0.0, help="the pinned region for 'pooled' (0: none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8, help="background base-model streams")
    ap.add_argument("--prompt-len", type=int, default=1600)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds before the first load and after each")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or not set(modes) <= {"eager", "deferred", "pooled"}:
        ap.error(f"--modes: some of eager, deferred, pooled, not {a.modes!r}")
    if "pooled" in modes and a.region_gib <= 0:
        ap.error("--modes pooled needs --region-gib > 0")
    report = asyncio.run(run(a.serve_config, a.adapter, modes, a.reps, a.streams, a.prompt_len, a.settle,
                             a.region_gib))
    print(summary(report))
    if a.json:
        a.json.write_text(report.model_dump_json(indent=1))


if __name__ == "__main__":
    main()
