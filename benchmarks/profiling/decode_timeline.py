"""A decode step's device timeline, with adapters against without: which kernels run, how long
each takes, and where the GPU sits idle between them.

Input: Chrome traces of decode steps (``benchmarks.profiling.step_profile --decode-trace DIR``
writes ``decode_<column>.json.gz`` per column), given as ``LABEL=PATH``, the first the run with
adapters, the last the baseline. Kernels are split into steps at idle gaps longer than
``--step-gap-ms`` (or, with ``--step-start REGEX``, at each kernel whose name matches: for
traces where the host keeps the GPU busy across steps); the decode steps are those with the
trace's most common kernel count (a CUDA-graph replay launches the same kernels every step; the
prefill step and stray steps differ). Where the host keeps the GPU busy across steps (no gap),
``--expect-steps N`` splits at the first kernel launched N or N + 1 times. Per column, averaged over those steps:

- the step: span (first kernel's start to last kernel's end), kernel time, idle time, kernels;
- per family (``step_profile.kernel_family``) and per kernel name: launches, kernel µs and the
  idle µs before its launches (the gap a kernel ends is charged to it);
- ``--layer``: one MoE layer of the median step, kernel by kernel (the kernels from the
  ``LAYER``-th attention kernel to the next), and ``--png`` draws it per column.

``python -m benchmarks.profiling.decode_timeline "with adapters=A.json.gz" "LoRA off=B.json.gz"
[--top 20] [--layer 2] [--png timeline.png] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from benchmarks.profiling.step_profile import kernel_family
from benchmarks.profiling.trace_gaps import (
    Cost,
    Kernel,
    Step,
    kernels_of,
    load_events,
    split_at_starts,
    split_steps,
    step_costs,
)


def per_step_kernel(kernels: list[Kernel], expect_steps: int) -> str | None:
    """The earliest-starting kernel name launched ``expect_steps`` or ``expect_steps + 1``
    times (once per decode step, the prefill step maybe too): where steps begin when no idle
    gap separates them (None: no such name)."""
    counts = Counter(k.name for k in kernels)
    for k in kernels:
        if counts[k.name] in (expect_steps, expect_steps + 1):
            return k.name
    return None


def decode_steps(steps: list[Step]) -> list[Step]:
    """The steps with the most common kernel count (ties: the larger count)."""
    if not steps:
        return []
    counts = Counter(len(s.kernels) for s in steps)
    mode = max(counts, key=lambda n: (counts[n], n))
    return [s for s in steps if len(s.kernels) == mode]


def mean_costs(steps: list[Step], key) -> dict[str, Cost]:
    """``step_costs`` averaged over ``steps``."""
    out: dict[str, Cost] = defaultdict(Cost)
    for s in steps:
        for name, c in step_costs(s, key).items():
            out[name].add(c, 1.0 / len(steps))
    return dict(out)


def layer_kernels(step: Step, layer: int) -> list[Kernel]:
    """The kernels of ``step`` from its ``layer``-th layer marker (0-based) up to the next one: one
    transformer layer's attention and what follows it (empty when the step has fewer markers).
    A layer launches several attention kernels (KV-cache write, split planning, the attention
    itself, sliding-window and full layers under different names); the marker is the attention
    kernel launched most often in the step (once per layer), the first of them in launch order
    on a tie."""
    counts = Counter(k.name for k in step.kernels if kernel_family(k.name) == "attention")
    if not counts:
        return []
    most = max(counts.values())
    marker = next(k.name for k in step.kernels if counts.get(k.name) == most)
    starts = [i for i, k in enumerate(step.kernels) if k.name == marker]
    if len(starts) <= layer + 1:
        return []
    return step.kernels[starts[layer]:starts[layer + 1]]


@dataclass
class Column:
    """One trace's decode steps."""

    label: str
    all_steps: list[Step]
    steps: list[Step]

    @property
    def median_step(self) -> Step:
        spans = sorted(self.steps, key=lambda s: s.span_ms)
        return spans[len(spans) // 2]

    def summary(self) -> dict[str, float]:
        n = len(self.steps)
        return {"steps": n, "kernels": len(self.steps[0].kernels),
                "span_ms": statistics.median(s.span_ms for s in self.steps),
                "busy_ms": sum(s.busy_ms for s in self.steps) / n,
                "idle_ms": sum(s.span_ms - s.busy_ms for s in self.steps) / n}


def load_column(label: str, path: str, step_gap_ms: float, step_start: str | None,
                expect_steps: int | None = None) -> Column:
    """One trace's steps; with ``expect_steps`` and no ``step_start``, a trace whose gaps give
    fewer than 2 decode steps is split at ``per_step_kernel`` instead."""
    kernels = kernels_of(load_events(path))
    steps = (split_at_starts(kernels, step_start) if step_start
             else split_steps(kernels, step_gap_ms))
    chosen = decode_steps(steps)
    if len(chosen) < 2 and not step_start and expect_steps:
        first = per_step_kernel(kernels, expect_steps)
        if first is not None:
            steps = split_at_starts(kernels, "^" + re.escape(first) + "$")
            chosen = decode_steps(steps)
    if not chosen:
        raise SystemExit(f"{path}: no kernels found")
    return Column(label, steps, chosen)


def _cost_table(title: str, columns: list[Column], key, top: int | None) -> dict:
    costs = [mean_costs(c.steps, key) for c in columns]
    base = costs[-1]
    names = set().union(*costs)

    def added(n: str) -> float:
        a, b = costs[0].get(n, Cost()), base.get(n, Cost())
        return (a.busy_us + a.idle_us) - (b.busy_us + b.idle_us)

    order = sorted(names, key=lambda n: -abs(added(n)))
    if top:
        order = order[:top]
    print(f"\n{title}: per decode step, launches / kernel µs / idle µs before them; the "
          f"fewest blocks per SM a launch had ({columns[0].label}; below 1: SMs left idle)")
    print("| " + " | ".join(["name", *[c.label for c in columns], "added µs (kernel + idle)",
                             "blocks/SM"]) + " |")
    print("|---|" + "---|" * (len(columns) + 2))
    for n in order:
        cells = []
        for cs in costs:
            c = cs.get(n, Cost())
            cells.append(f"{c.launches:.0f} / {c.busy_us:.1f} / {c.idle_us:.1f}")
        bps = costs[0].get(n, Cost()).blocks_per_sm
        print(f"| `{n[:70]}` | " + " | ".join(cells) + f" | {added(n):+.1f} | "
              + ("-" if bps is None else f"{bps:.2f}") + " |")
    return {c.label: {n: vars(v) for n, v in cs.items()} for c, cs in zip(columns, costs)}


def print_layer(columns: list[Column], layer: int) -> dict:
    """One layer of each column's median step, kernel by kernel: µs from the layer's start,
    duration, idle before."""
    out = {}
    for col in columns:
        ks = layer_kernels(col.median_step, layer)
        if not ks:
            print(f"\n{col.label}: fewer than {layer + 2} attention kernels in a step; no layer")
            continue
        t0 = ks[0].start
        print(f"\n{col.label}: layer {layer} of the median step ({len(ks)} kernels, "
              f"{(ks[-1].end - t0):.1f} µs to the last kernel's end)")
        print("| start µs | kernel µs | idle before µs | blocks/SM | family | kernel |")
        print("|---|---|---|---|---|---|")
        rows, end = [], t0
        for k in ks:
            rows.append({"name": k.name, "start_us": k.start - t0, "dur_us": k.end - k.start,
                         "idle_us": max(0.0, k.start - end), "family": kernel_family(k.name),
                         "blocks_per_sm": k.blocks_per_sm})
            r = rows[-1]
            bps = "-" if k.blocks_per_sm is None else f"{k.blocks_per_sm:.2f}"
            print(f"| {r['start_us']:.1f} | {r['dur_us']:.1f} | {r['idle_us']:.1f} | {bps} | "
                  f"{r['family']} | `{k.name[:60]}` |")
            end = max(end, k.end)
        out[col.label] = rows
    return out


def plot_layers(layers: dict[str, list[dict]], path: str) -> str:
    """One row per column: the layer's kernels as bars coloured by family."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed ({path} not written)"
    families = sorted({r["family"] for rows in layers.values() for r in rows})
    colours = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.7 * len(layers)))
    for y, (label, rows) in enumerate(layers.items()):
        for r in rows:
            ax.barh(y, r["dur_us"], left=r["start_us"], color=colours[r["family"]],
                    edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(layers)), list(layers))
    ax.invert_yaxis()
    ax.set_xlabel("µs from the layer's attention kernel")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[f]) for f in families],
              labels=families, loc="upper center", bbox_to_anchor=(0.5, -0.35),
              ncol=min(4, len(families)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def report(pairs: list[tuple[str, str]], *, step_gap_ms: float = 0.3,
           step_start: str | None = None, top: int = 20, layer: int | None = None,
           png: str | None = None, expect_steps: int | None = None) -> dict:
    """Prints the tables for ``(label, path)`` columns (first: with adapters, last: baseline);
    returns the figures."""
    columns = [load_column(label, path, step_gap_ms, step_start, expect_steps)
               for label, path in pairs]
    print("\ndecode steps (the trace's steps of its most common kernel count); ms per step")
    print("| column | steps used / found | kernels | span p50 | kernel time | idle |")
    print("|---|---|---|---|---|---|")
    summaries = {}
    for c in columns:
        s = summaries[c.label] = c.summary()
        print(f"| {c.label} | {s['steps']} / {len(c.all_steps)} | {s['kernels']} | "
              f"{s['span_ms']:.3f} | {s['busy_ms']:.3f} | {s['idle_ms']:.3f} |")
    first, base = summaries[columns[0].label], summaries[columns[-1].label]
    print(f"\nspan {first['span_ms'] / base['span_ms']:.3f}× the baseline's "
          f"({first['span_ms'] - base['span_ms']:+.3f} ms: kernels "
          f"{first['busy_ms'] - base['busy_ms']:+.3f}, idle {first['idle_ms'] - base['idle_ms']:+.3f})")
    out = {"summary": summaries,
           "families": _cost_table("families", columns, lambda k: kernel_family(k.name), None),
           "kernels": _cost_table(f"top {top} kernels by time added", columns,
                                  lambda k: k.name, top)}
    if layer is not None:
        out["layer"] = print_layer(columns, layer)
        if png and out["layer"]:
            print(plot_layers(out["layer"], png))
    return out


def _pair(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=_pair, metavar="LABEL=PATH",
                    help="first: with adapters; last: the baseline")
    ap.add_argument("--step-gap-ms", type=float, default=0.3,
                    help="idle longer than this ends a step (default 0.3)")
    ap.add_argument("--step-start", default=None, metavar="REGEX",
                    help="instead: a step begins at each kernel whose name matches")
    ap.add_argument("--expect-steps", type=int, default=None, metavar="N",
                    help="the trace's decode steps: when no idle gap separates them, split at a "
                         "kernel launched N (or N+1) times")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--layer", type=int, default=None, metavar="N",
                    help="also layer N of the median step, kernel by kernel")
    ap.add_argument("--png", default=None, help="with --layer: draw the layers here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = report(args.traces, step_gap_ms=args.step_gap_ms, step_start=args.step_start,
                 top=args.top, layer=args.layer, png=args.png, expect_steps=args.expect_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
