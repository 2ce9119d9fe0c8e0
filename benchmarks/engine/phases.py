"""The load phases of ``benchmarks.engine.serving`` against one ``AsyncLLM``-like engine, and
the side-by-side table.

``engine.generate(prompt, sampling_params, request_id, lora_request=...)`` is an async iterator
of outputs with ``outputs[0].token_ids`` (DELTA: the new tokens of each step).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.engine.step_timeline import (
    format_steps,
    phase_step_durations,
    prefill_steps,
)


@dataclass
class Workload:
    """One run's load: ``conc`` concurrent requests of ``in_len`` random prompt ids and
    ``out_len`` output tokens; ``burst_reps`` bursts, then a closed loop of ``per_worker``
    requests per worker."""

    conc: int = 16
    in_len: int = 1600
    out_len: int = 600
    burst_reps: int = 2
    per_worker: int = 3


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(recs: list[dict], t0: float, t1: float) -> dict:
    """Per-phase figures (ms, tokens/s) of request records ``{t_sub, t_first, t_end, n}``."""
    ttft = [1e3 * (r["t_first"] - r["t_sub"]) for r in recs]
    tpot = [1e3 * (r["t_end"] - r["t_first"]) / max(r["n"] - 1, 1) for r in recs]
    return {"requests": len(recs), "ttft_ms_mean": statistics.fmean(ttft),
            "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p90": percentile(ttft, 0.9),
            "tpot_ms_mean": statistics.fmean(tpot),
            "out_tok_s": sum(r["n"] for r in recs) / max(t1 - t0, 1e-9)}


async def run_phases(engine, w: Workload, lora_requests: list, vocab: tuple[int, int],
                     steps: list | None = None) -> dict:
    """Warm-up, ``w.burst_reps`` bursts and one steady phase; returns their summaries.

    ``steps``: the engine's step records (``benchmarks.engine.step_timeline.StepRecorder``'s sink), if
    it has one: each burst's summary then also lists its prefill steps (``prefill_steps``), and
    the steady phase's gives the median duration of its steps with and without a new prompt
    (``phase_step_durations``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(0)
    counter = iter(range(1 << 30))

    async def request(i: int, out_len: int) -> dict:
        sp = SamplingParams(max_tokens=out_len, min_tokens=out_len, ignore_eos=True,
                            temperature=1.0, detokenize=False, output_kind=RequestOutputKind.DELTA)
        prompt = {"prompt_token_ids": [rng.randrange(*vocab) for _ in range(w.in_len)]}
        lora = lora_requests[i % len(lora_requests)] if lora_requests else None
        rec = {"t_sub": time.perf_counter(), "t_first": None, "n": 0}
        async for out in engine.generate(prompt, sp, f"r{next(counter)}", lora_request=lora):
            k = len(out.outputs[0].token_ids)
            if k and rec["t_first"] is None:
                rec["t_first"] = time.perf_counter()
            rec["n"] += k
        rec["t_end"] = time.perf_counter()
        assert rec["n"] == out_len, f"expected {out_len} tokens, got {rec['n']}"
        return rec

    async def wave(out_len: int) -> tuple[list[dict], float, float]:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*[request(i, out_len) for i in range(w.conc)])
        return list(recs), t0, time.perf_counter()

    for out_len in (min(16, w.out_len), min(64, w.out_len)):  # adapters resident, kernels ready
        _, t0, t1 = await wave(out_len)

    async def late(j: int, delay_s: float, out_len: int) -> dict:
        await asyncio.sleep(delay_s)
        return await request(j, out_len)

    # staggered: prompts arriving while others decode (the mixed steps of the steady phase)
    await asyncio.gather(*[late(j, (t1 - t0) * j / w.conc, min(64, w.out_len))
                           for j in range(w.conc)])
    phases = {}
    for k in range(w.burst_reps):
        recs, t0, t1 = await wave(w.out_len)
        phases[f"burst{k}"] = summarize(recs, t0, t1)
        if steps is not None:
            phases[f"burst{k}"]["prefill_steps"] = prefill_steps(
                steps, t0, max(r["t_first"] for r in recs))
    burst_s = t1 - t0
    started: list[float] = []

    async def worker(j: int) -> list[dict]:
        await asyncio.sleep(burst_s * j / w.conc)
        started.append(time.perf_counter())
        return [await request(j, w.out_len) for _ in range(w.per_worker)]

    t0 = time.perf_counter()
    per_worker = await asyncio.gather(*[worker(j) for j in range(w.conc)])
    t1 = time.perf_counter()
    recs = [r for rs in per_worker for r in rs]
    phases["steady"] = summarize(recs, t0, t1)
    if steps is not None:
        phases["steady"]["steps"] = phase_step_durations(steps, t0, t1)
    all_in, first_done = max(started), min(rs[-1]["t_end"] for rs in per_worker)
    window = [r for r in recs if r["t_sub"] >= all_in and r["t_end"] <= first_done]
    if window:
        phases["steady_window"] = summarize(window, all_in, first_done)
    return phases


def print_table(results: list[dict], title: str) -> None:
    """Markdown table, one row per run; ratios against the ``base`` run when there is one."""
    base = next((r for r in results if r["run"] == "base"), None)

    def ratio(r: dict, phase: str, key: str) -> str:
        if base is None or r is base or phase not in r["phases"] or phase not in base["phases"]:
            return ""
        return f" ({r['phases'][phase][key] / base['phases'][phase][key]:.2f}×)"

    print(f"\n{title}")
    print("| run | burst TPOT ms | burst TTFT ms mean / p50 | steady TPOT ms "
          "| steady TTFT ms mean / p50 / p90 | steady out tok/s | engine start s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ph = r["phases"]
        burst = f"burst{len([k for k in ph if k.startswith('burst')]) - 1}"
        b, s = ph[burst], ph["steady"]
        print(f"| {r['run']} | {b['tpot_ms_mean']:.2f}{ratio(r, burst, 'tpot_ms_mean')} "
              f"| {b['ttft_ms_mean']:.0f}{ratio(r, burst, 'ttft_ms_mean')} / "
              f"{b['ttft_ms_p50']:.0f}{ratio(r, burst, 'ttft_ms_p50')} "
              f"| {s['tpot_ms_mean']:.2f}{ratio(r, 'steady', 'tpot_ms_mean')} "
              f"| {s['ttft_ms_mean']:.0f} / {s['ttft_ms_p50']:.0f}"
              f"{ratio(r, 'steady', 'ttft_ms_p50')} / {s['ttft_ms_p90']:.0f} "
              f"| {s['out_tok_s']:.0f} | {r['engine_init_s']:.0f} |")
    for r in results:  # where a burst's TTFT went: its prefill steps, ms each (first tokens)
        for name, ph in r["phases"].items():
            if "prefill_steps" in ph:
                print(f"{r['run']} {name} prefill, {format_steps(ph['prefill_steps'])}")
        if "steps" in r["phases"]["steady"]:  # where steady TTFT went: its steps with a prompt
            st = r["phases"]["steady"]["steps"]
            print(f"{r['run']} steady: {st['prefill_steps']} steps with a new prompt, p50 "
                  f"{st['prefill_step_ms_p50']:.1f} ms, longest {st['prefill_step_ms_max']:.0f}; "
                  f"{st['decode_steps']} without, p50 {st['decode_step_ms_p50']:.1f} ms, "
                  f"longest {st['decode_step_ms_max']:.0f}")
