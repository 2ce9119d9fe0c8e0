"""What a run shows and keeps: the printed tables, the plot, the JSON report."""

from __future__ import annotations

from pathlib import Path

from benchmarks.loadgen.spec import (
    BenchReport,
    LoadResult,
    Percentiles,
    VllmBenchResult,
)


def _ms(p: Percentiles | None, field: str) -> str:
    return f"{getattr(p, field):.1f}" if p else "-"


def _io(prompt: float | None, output: float | None) -> str:
    return f"{prompt or 0:.1f}/{output or 0:.1f}"


def print_table(runs: list[LoadResult]) -> None:
    """One row per system x concurrency."""
    head = (f"{'system':22} {'conc':>4} {'reqs':>5} {'fail':>4} {'in/out tok':>10} {'TTFT p50':>9} {'p90':>8} "
            f"{'p99':>8} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'e2e p50':>8} "
            f"{'p99':>8} {'tok/s/req':>9} {'out tok/s':>9}")
    print(head + "\n" + "-" * len(head))
    for r in runs:
        a = r.aggregate
        io = _io(a.mean_prompt_tokens, a.mean_output_tokens)
        rate = f"{a.tokens_per_s_per_request:.1f}" if a.tokens_per_s_per_request else "-"
        print(f"{r.system:22} {r.spec.concurrency:>4} {a.requests:>5} {a.failures:>4} {io:>10} "
              f"{_ms(a.ttft_ms, 'p50'):>9} {_ms(a.ttft_ms, 'p90'):>8} {_ms(a.ttft_ms, 'p99'):>8} "
              f"{_ms(a.itl_ms, 'p50'):>8} {_ms(a.itl_ms, 'p90'):>7} {_ms(a.itl_ms, 'p99'):>7} "
              f"{_ms(a.tpot_ms, 'p50'):>9} {_ms(a.tpot_ms, 'p99'):>7} {_ms(a.e2e_ms, 'p50'):>8} "
              f"{_ms(a.e2e_ms, 'p99'):>8} {rate:>9} {a.output_throughput_tok_s:>9.1f}")
    print("latencies in ms; tok/s/req: mean output tokens/s of one request; out tok/s: output tokens / phase wall time")


def print_failures(runs: list[LoadResult]) -> None:
    """Failures by status per phase, with the first error body of each status (where the records
    were kept: a published report keeps the aggregates only)."""
    for r in runs:
        for status in r.aggregate.errors:
            first = next((x for x in r.records if not x.ok and str(x.status) == status), None)
            print(f"{r.system} c={r.spec.concurrency}: {r.aggregate.errors[status]} failed with status {status}"
                  + (f": {(first.error or '')[:300]}" if first else ""))


def print_vllm_comparison(pairs: list[tuple[LoadResult, VllmBenchResult]]) -> None:
    """Our phase and vLLM's client on the same endpoint, row beside row."""
    head = (f"{'system':22} {'conc':>4} {'client':12} {'ok':>4} {'in/out tok':>10} {'TTFT p50':>9} {'p99':>8} "
            f"{'ITL p50':>8} {'p99':>7} {'TPOT p50':>9} {'e2e p50':>8} {'out tok/s':>9}")
    print("\nbeside vLLM's own client (vllm bench serve, random dataset, same lengths, concurrency, models):")
    print(head + "\n" + "-" * len(head))
    for ours, theirs in pairs:
        a, f = ours.aggregate, theirs.figures
        print(f"{ours.system:22} {ours.spec.concurrency:>4} {'http_serving':12} {a.requests - a.failures:>4} "
              f"{_io(a.mean_prompt_tokens, a.mean_output_tokens):>10} {_ms(a.ttft_ms, 'p50'):>9} "
              f"{_ms(a.ttft_ms, 'p99'):>8} {_ms(a.itl_ms, 'p50'):>8} {_ms(a.itl_ms, 'p99'):>7} "
              f"{_ms(a.tpot_ms, 'p50'):>9} {_ms(a.e2e_ms, 'p50'):>8} {a.output_throughput_tok_s:>9.1f}")
        if not f:
            print(f"{'':22} {'':>4} {'vllm bench':12} {theirs.note}")
            continue
        n = f.get("completed") or 0
        io = _io((f.get("total_input_tokens") or 0) / max(n, 1), (f.get("total_output_tokens") or 0) / max(n, 1))
        g = {k: (f"{v:.1f}" if isinstance(v, (int, float)) else "-") for k, v in f.items()}
        print(f"{'':22} {'':>4} {'vllm bench':12} {n:>4} {io:>10} {g['p50_ttft_ms']:>9} {g['p99_ttft_ms']:>8} "
              f"{g['p50_itl_ms']:>8} {g['p99_itl_ms']:>7} {g['p50_tpot_ms']:>9} {g['p50_e2el_ms']:>8} "
              f"{g['output_throughput']:>9}" + (f"  ({theirs.note})" if theirs.note else ""))
    print("vllm bench: ITL is per chunk with choices (empty-text chunks too), TTFT at the first chunk with "
          "choices, TPOT = (e2e - TTFT) / (tokens - 1)")


def write_plot(runs: list[LoadResult], path: Path) -> str:
    """TTFT p50, output tokens/s per request and output tokens/s of the whole phase by
    concurrency, one line per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot skipped: matplotlib is not installed in this environment ({path} not written)"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for system in dict.fromkeys(r.system for r in runs):
        rows = sorted((r for r in runs if r.system == system), key=lambda r: r.spec.concurrency)
        conc = [r.spec.concurrency for r in rows]
        ttft = [r.aggregate.ttft_ms.p50 if r.aggregate.ttft_ms else float("nan") for r in rows]
        ax1.plot(conc, ttft, "o-", label=system)
        ax2.plot(conc, [r.aggregate.tokens_per_s_per_request or float("nan") for r in rows], "o-", label=system)
        ax3.plot(conc, [r.aggregate.output_throughput_tok_s or float("nan") for r in rows], "o-", label=system)
    for ax, label in ((ax1, "TTFT p50 (ms)"), (ax2, "output tokens/s per request"), (ax3, "output tokens/s (all requests)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def write_report(report: BenchReport, path: Path) -> None:
    """The report as JSON (keys are never in it: TargetSpec leaves them out)."""
    path.write_text(report.model_dump_json(indent=1))


def read_report(path: Path) -> BenchReport:
    """A report written by ``write_report``."""
    return BenchReport.model_validate_json(path.read_text())
