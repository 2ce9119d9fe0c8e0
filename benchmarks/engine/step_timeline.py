"""The engine's steps as the front end sees them: a vLLM stat logger that records one entry per
engine step, and the summary of a burst's prefill steps.

vLLM's ``AsyncLLM`` hands every step's scheduler stats to its stat loggers (``stat_loggers=``
in ``AsyncLLM.from_engine_args``; a custom logger turns stats on without vLLM's default
loggers). ``StepRecorder`` keeps, per step, the front end's ``time.perf_counter()`` when the
step's outputs arrived, the running and waiting request counts after it, and how many requests
got their first token in it. The serving benchmark slices that list per phase: a burst's
*prefill steps* are the steps from its submission until its last first token, so a step that
stalls (a compile, a host-side hiccup) or an extra step shows as such, not only as a larger TTFT.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass
class Step:
    """One engine step: ``t`` front-end ``perf_counter`` seconds at its outputs' arrival;
    ``running`` / ``waiting`` requests after it; ``first_tokens`` requests whose first token it
    produced; ``new_tokens`` tokens it generated."""

    t: float
    running: int
    waiting: int
    first_tokens: int
    new_tokens: int


class StepRecorder(StatLoggerBase):
    """Per-engine stat logger appending a ``Step`` per engine step to ``sink`` (shared list)."""

    def __init__(self, vllm_config, engine_index: int = 0, sink: list[Step] | None = None):
        self.sink = sink if sink is not None else []

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:  # stats come with every step once a logger asks for them
            return
        it = iteration_stats
        self.sink.append(Step(time.perf_counter(), scheduler_stats.num_running_reqs,
                              scheduler_stats.num_waiting_reqs,
                              len(it.time_to_first_tokens_iter) if it is not None else 0,
                              it.num_generation_tokens if it is not None else 0))

    def log_engine_initialized(self):
        pass


def recorder_factory(sink: list[Step]):
    """The ``stat_loggers`` entry for ``AsyncLLM``: builds a ``StepRecorder`` writing to
    ``sink``."""
    return lambda vllm_config, engine_index=0: StepRecorder(vllm_config, engine_index, sink)


def prefill_steps(steps: list[Step], t_submit: float, t_last_first: float) -> list[dict]:
    """The steps of a burst submitted at ``t_submit`` up to the one that gave its last first
    token (arrived by ``t_last_first``): per step, ms since submission, its duration (ms since
    the previous step, or since submission for the first), the requests it gave a first token,
    and the waiting count after it."""
    out, prev = [], t_submit
    for s in steps:
        if s.t <= t_submit:
            continue
        if s.t > t_last_first + 1e-3:
            break
        out.append({"at_ms": 1e3 * (s.t - t_submit), "ms": 1e3 * (s.t - prev),
                    "first_tokens": s.first_tokens, "waiting": s.waiting})
        prev = s.t
    return out


def phase_step_durations(steps: list[Step], t0: float, t1: float) -> dict:
    """The steps that ended within ``(t0, t1]`` (a phase where the engine is never idle, so a
    step's duration is the time since the previous step's outputs arrived), split into those
    that gave some request its first token (*prefill*: a new prompt ran in them, mixed with the
    others' decode) and the rest (*decode*): count, median and longest ms of each (a stall, such
    as a compile, shows as a longest step far above the median)."""
    durations: dict[str, list[float]] = {"prefill": [], "decode": []}
    for prev, s in zip(steps, steps[1:]):
        if t0 < s.t <= t1:
            durations["prefill" if s.first_tokens else "decode"].append(1e3 * (s.t - prev.t))
    return {f"{kind}_steps": len(ms) for kind, ms in durations.items()} | {
        f"{kind}_step_ms_p50": statistics.median(ms) if ms else float("nan")
        for kind, ms in durations.items()} | {
        f"{kind}_step_ms_max": max(ms) if ms else float("nan") for kind, ms in durations.items()}


def format_steps(steps: list[dict]) -> str:
    """``n steps: 131 (5), 128 (5), ...`` — each step's ms and, in brackets, the first tokens
    it gave."""
    return f"{len(steps)} steps: " + ", ".join(f"{s['ms']:.0f} ({s['first_tokens']})"
                                               for s in steps)
