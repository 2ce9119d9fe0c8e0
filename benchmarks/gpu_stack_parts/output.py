"""What a run prints and keeps: every phase's table, the side-by-side and target tables (also
as a text file), the JSON report and the plot."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from benchmarks.gpu_stack_parts.models import StackReport
from benchmarks.gpu_stack_parts.plan import Plan
from benchmarks.gpu_stack_parts.targets import (
    overhead_table,
    short_error,
    system_table,
    targets_table,
)
from benchmarks.loadgen.report import print_failures, print_table, print_vllm_comparison, write_plot
from benchmarks.loadgen.spec import LoadResult


def _concurrency_phase(name: str) -> bool:
    return name.startswith("c") and name[1:].isdigit()


def phase_runs(report: StackReport) -> list[LoadResult]:
    """Every measured phase, named ``system phase`` for the tables."""
    return [p.result.model_copy(update={"system": f"{s.system} {p.name}"}) for s in report.systems for p in s.phases]


def plot_runs(report: StackReport) -> list[LoadResult]:
    """The concurrency phases of the seed adapters, one line per system."""
    return [p.result.model_copy(update={"system": s.system}) for s in report.systems for p in s.phases
            if _concurrency_phase(p.name)]


def summary_text(report: StackReport, plan: Plan) -> str:
    """The tables, as printed at the end."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runs = phase_runs(report)
        if runs:
            print_table(runs)
            print_failures(runs)
        if pairs := [(c.ours, c.bench) for s in report.systems for c in s.cross_checks]:
            print_vllm_comparison(pairs)
        print()
        print("\n".join(system_table(report, plan)))
        print("\nloraplex over HTTP minus its engine alone:")
        print("\n".join(overhead_table(report)))
        for s in report.systems:
            if s.route_check:
                r = s.route_check
                print(f"\nrouting check ({s.system}, eager engine, hooks on the routers): "
                      + (f"missing ({r.error})" if r.error else
                         f"{r.distinct_mean:.1f} distinct experts of {r.experts} per MoE layer per decode step of "
                         f"{r.decode_tokens} tokens (min {r.distinct_min}, {r.steps} steps, {r.layers} layers; "
                         f"top-{r.top_k} routed uniformly at random would give {r.uniform_expectation:.1f})"))
        if report.pushes:
            ok = [p for p in report.pushes if p.ok]
            secs = sorted(p.seconds for p in ok)
            print(f"\npushes (loraplex adapters push): {len(ok)} of {len(report.pushes)} ok"
                  + (f", median {secs[len(secs) // 2]:.1f} s, max {secs[-1]:.1f} s" if secs else ""))
        print("\ntargets:")
        print("\n".join(targets_table(report, plan)))
        for s in report.systems:
            print(f"\n{s.system}: started {s.started_at or '-'}, ready after "
                  f"{'-' if s.start_s is None else f'{s.start_s:.1f} s'}; command: {s.command or '-'}"
                  + (f"; env {s.env}" if s.env else "")
                  + (f"; its first start failed ({short_error(s.first_start_error)})" if s.first_start_error else ""))
    return buf.getvalue()


def write_outputs(report: StackReport, plan: Plan, out_dir: Path) -> str:
    """JSON report, the tables as text and the plot in ``out_dir``; returns the tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_stack.json").write_text(report.model_dump_json(indent=1))
    text = summary_text(report, plan)
    (out_dir / "gpu_stack_table.md").write_text(text)
    runs = plot_runs(report)
    note = write_plot(runs, out_dir / "gpu_stack.png") if runs else "plot skipped: no concurrency phase ran"
    return text + f"\n{note}\nreport: {out_dir / 'gpu_stack.json'}, tables: {out_dir / 'gpu_stack_table.md'}\n"
