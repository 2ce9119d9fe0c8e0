"""Where the GPU waits in a ``torch.profiler`` Chrome trace (``benchmarks.profiling.mixed_steps
.traced_pass``'s ``.json.gz``): the kernels split into engine steps, per step its span, the
time kernels ran and the time the GPU sat idle between them, and the idle gaps that cost the
most, summed by the kernel that ended each wait and by the host op that launched it.

A step whose idle time is most of its span is host-bound: the kernels wait for the CPU to
launch them, and the kernels that most often end a long wait show whose host work sits in
front of them. Steps are separated by gaps longer than ``--step-gap-ms`` (the host's work
between two forwards: scheduling, sampling, output processing).

``python -m benchmarks.profiling.trace_gaps TRACE.json.gz [--top 15] [--step-gap-ms 2]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Kernel:
    """One kernel on the GPU timeline (µs) with the host op whose launch call started it."""

    name: str
    start: float
    end: float
    correlation: int | None = None
    launched_by: str = "?"
    blocks_per_sm: float | None = None  # the profiler's "blocks per SM": < 1 leaves SMs idle


@dataclass
class Step:
    """Kernels run back to back enough to be one engine step."""

    kernels: list[Kernel] = field(default_factory=list)

    @property
    def span_ms(self) -> float:
        return (self.kernels[-1].end - self.kernels[0].start) / 1e3

    @property
    def busy_ms(self) -> float:
        return sum(k.end - k.start for k in self.kernels) / 1e3


def load_events(path: str) -> list[dict]:
    """The trace's events (``.json.gz`` or ``.json``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernels_of(events: list[dict]) -> list[Kernel]:
    """GPU kernels in start order, each with the innermost host op (``cpu_op``, same thread)
    around the runtime call that launched it (matched by the ``correlation`` id)."""
    ops_by_tid: dict = defaultdict(list)
    launches = {}
    kernels = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat == "cpu_op":
            ops_by_tid[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = (e.get("tid"), e["ts"])
        elif cat == "kernel":
            args = e.get("args", {})
            kernels.append(Kernel(e["name"], e["ts"], e["ts"] + e.get("dur", 0),
                                  args.get("correlation"), blocks_per_sm=args.get("blocks per SM")))
    for ops in ops_by_tid.values():
        ops.sort()
    for k in kernels:
        launch = launches.get(k.correlation)
        if launch is not None:
            tid, ts = launch
            inner = [op for op in ops_by_tid.get(tid, ()) if op[0] <= ts <= op[1]]
            if inner:  # the innermost: the latest to start among those around the call
                k.launched_by = max(inner)[2]
    kernels.sort(key=lambda k: k.start)
    return kernels


def split_steps(kernels: list[Kernel], step_gap_ms: float) -> list[Step]:
    """Consecutive kernels with idle gaps shorter than ``step_gap_ms`` form one step."""
    steps: list[Step] = []
    for k in kernels:
        if not steps or k.start - steps[-1].kernels[-1].end > step_gap_ms * 1e3:
            steps.append(Step())
        steps[-1].kernels.append(k)
    return steps


def split_at_starts(kernels: list[Kernel], pattern: str) -> list[Step]:
    """Steps beginning at each kernel whose name matches ``pattern`` (kernels before the first
    match are dropped)."""
    rx = re.compile(pattern)
    steps: list[Step] = []
    for k in kernels:
        if rx.search(k.name):
            steps.append(Step())
        if steps:
            steps[-1].kernels.append(k)
    return steps


@dataclass
class Cost:
    """Launches, kernel µs and idle µs before those launches (of a step, or averaged over
    steps), and the fewest blocks per SM a launch had."""

    launches: float = 0.0
    busy_us: float = 0.0
    idle_us: float = 0.0
    blocks_per_sm: float | None = None  # the smallest seen (the profiler's figure)

    def add(self, other: Cost, weight: float) -> None:
        self.launches += other.launches * weight
        self.busy_us += other.busy_us * weight
        self.idle_us += other.idle_us * weight
        self.blocks_per_sm = _least(self.blocks_per_sm, other.blocks_per_sm)


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def step_costs(step: Step, key) -> dict[str, Cost]:
    """``key(kernel)`` -> ``Cost`` of one step; the idle time between two kernels is charged to
    the later one (the first kernel's to none)."""
    out: dict[str, Cost] = defaultdict(Cost)
    end = None
    for k in step.kernels:
        c = out[key(k)]
        c.launches += 1
        c.busy_us += k.end - k.start
        c.blocks_per_sm = _least(c.blocks_per_sm, k.blocks_per_sm)
        if end is not None and k.start > end:
            c.idle_us += k.start - end
        end = k.end if end is None else max(end, k.end)
    return out


def gap_costs(step: Step) -> tuple[dict[str, float], dict[str, float]]:
    """Idle µs before each kernel of ``step``, summed by kernel name and by launching host op
    (only those that ended a wait)."""
    def idle_by(key) -> dict[str, float]:
        return {name: c.idle_us for name, c in step_costs(step, key).items() if c.idle_us > 0}

    return idle_by(lambda k: k.name[:80]), idle_by(lambda k: k.launched_by[:80])


def report(path: str, top: int = 15, step_gap_ms: float = 2.0, min_kernels: int = 200) -> dict:
    """Prints the step table of the trace and, for its steps of at least ``min_kernels``
    kernels (eager forwards), the gaps that cost the most; returns the figures."""
    steps = split_steps(kernels_of(load_events(path)), step_gap_ms)
    print(f"\n{path}: {len(steps)} steps (kernels closer than {step_gap_ms} ms)")
    print("| step | kernels | span ms | kernels ms | idle ms |")
    print("|---|---|---|---|---|")
    rows = []
    for i, s in enumerate(steps):
        rows.append({"kernels": len(s.kernels), "span_ms": s.span_ms, "busy_ms": s.busy_ms})
        print(f"| {i} | {len(s.kernels)} | {s.span_ms:.2f} | {s.busy_ms:.2f} | "
              f"{s.span_ms - s.busy_ms:.2f} |")
    big = [s for s in steps if len(s.kernels) >= min_kernels]
    by_kernel: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for s in big:
        k_costs, op_costs = gap_costs(s)
        for name, us in k_costs.items():
            by_kernel[name] += us
        for name, us in op_costs.items():
            by_op[name] += us
    for title, costs in (("kernel that ended the wait", by_kernel),
                         ("host op that launched it", by_op)):
        print(f"\nidle ms per step before each {title} ({len(big)} steps of >= {min_kernels} "
              "kernels)")
        for name, us in sorted(costs.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {us / 1e3 / max(1, len(big)):8.3f}  {name}")
    return {"steps": rows, "idle_by_kernel": dict(by_kernel), "idle_by_op": dict(by_op)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--step-gap-ms", type=float, default=2.0)
    ap.add_argument("--min-kernels", type=int, default=200)
    args = ap.parse_args(argv)
    for path in args.traces:
        report(path, args.top, args.step_gap_ms, args.min_kernels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
