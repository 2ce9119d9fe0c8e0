"""The figures of a run side by side, and each target against its figure.

Every figure is read from the report; one that was not measured prints as ``missing`` with why,
never as a number. Seed phase: the plan's seed concurrency with its seed adapters (``c<conc>``).
Decode step = inter-token latency p50 (a request's TPOT also holds any step stalled by a kernel
compile or a prefill mixed into the batch; the median gap between tokens is the plain step);
tok/s per request = the mean of the requests' output tokens/s.
"""

from __future__ import annotations

from benchmarks.gpu_stack_parts.models import PhaseResult, StackReport, SystemRun
from benchmarks.gpu_stack_parts.plan import Plan

CLIFF_MS = 1000.0  # a p99 TTFT rise of this much over the working set that fits counts as a cliff


def _system(report: StackReport, name: str) -> SystemRun | None:
    return next((s for s in report.systems if s.system == name), None)


def _phase(report: StackReport, system: str, phase: str) -> PhaseResult | None:
    s = _system(report, system)
    return next((p for p in s.phases if p.name == phase), None) if s else None


def figure(report: StackReport, system: str, phase: str, what: str) -> tuple[float | None, str]:
    """``(value, why missing)`` of ``ttft``/``tpot``/``itl`` (p50, ms), ``ttft_p99`` or ``rate`` (tok/s per request)."""
    s = _system(report, system)
    if s is None:
        return None, f"{system} not in this run"
    p = _phase(report, system, phase)
    if p is None:
        return None, f"{system} has no phase {phase}" + (f" ({short_error(s.error)})" if s.error else "")
    a = p.result.aggregate
    if a.failures:
        return None, f"{system} {phase}: {a.failures} of {a.requests} requests failed"
    value = {"ttft": a.ttft_ms and a.ttft_ms.p50, "ttft_p99": a.ttft_ms and a.ttft_ms.p99,
             "tpot": a.tpot_ms and a.tpot_ms.p50, "itl": a.itl_ms and a.itl_ms.p50,
             "rate": a.tokens_per_s_per_request}[what]
    return (value, "") if value is not None else (None, f"{system} {phase}: no {what}")


def short_error(text: str) -> str:
    """The line of an error text (a log's tail included) that says most: its last exception line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if ("Error" in line or "Exception" in line) and "Warning" not in line]
    return (named[-1] if named else lines[0] if lines else "")[:200]


def _fmt(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "missing" if v is None else f"{v:.{digits}f}{unit}"


def system_table(report: StackReport, plan: Plan) -> list[str]:
    """One row per system at the seed phase, ratios against (a), (b) and (c)."""
    seed = f"c{plan.workload.concurrency}"
    step_a, _ = figure(report, "vllm-base", seed, "itl")
    ttft_a, _ = figure(report, "vllm-base", seed, "ttft")
    rate_b, _ = figure(report, "vllm-lora", seed, "rate")
    rate_c, _ = figure(report, "ray-llm", seed, "rate")

    def ratio(x, y):
        return f" ({x / y:.2f}×)" if x is not None and y else ""

    rows = [(f"seed phase {seed}: {plan.workload.concurrency} concurrent, {plan.workload.input_len} in / "
            f"{plan.workload.output_len} out"),
            ("| system | start s | decode step (ITL p50) ms, × (a) | TPOT p50 ms | out tok/s per request, × (b), × (c) "
            "| TTFT p50 ms, × (a) | versions | note |"), "|---|---|---|---|---|---|---|---|"]
    for s in report.systems:
        step, why1 = figure(report, s.system, seed, "itl")
        tpot, _ = figure(report, s.system, seed, "tpot")
        rate, why2 = figure(report, s.system, seed, "rate")
        ttft, why3 = figure(report, s.system, seed, "ttft")
        note = short_error(s.error or why1 or why2 or why3 or "")
        v = s.versions
        rows.append(f"| {s.label} | {_fmt(s.start_s, digits=0)} | {_fmt(step)}{ratio(step, step_a)} | {_fmt(tpot)} "
                    f"| {_fmt(rate, digits=1)}{ratio(rate, rate_b)}{ratio(rate, rate_c)} "
                    f"| {_fmt(ttft, digits=1)}{ratio(ttft, ttft_a)} | vLLM {v.get('vllm', '?')}, torch "
                    f"{v.get('torch', '?')}, Ray {v.get('ray', '?')}, {v.get('gpu', '?')} | {note} |")
    return rows


def overhead_table(report: StackReport) -> list[str]:
    """loraplex over HTTP minus its engine alone, per phase both ran."""
    d, e = _system(report, "loraplex"), _system(report, "engine-alone")
    if d is None or e is None:
        return ["HTTP path minus engine alone: missing (loraplex or the engine alone not in this run)"]
    rows = ["| phase | TTFT p50 ms loraplex / engine / Δ | TPOT p50 ms loraplex / engine / Δ% |", "|---|---|---|"]
    for p in d.phases:
        if any(q.name == p.name for q in e.phases):
            t = [figure(report, s, p.name, "ttft")[0] for s in ("loraplex", "engine-alone")]
            s_ = [figure(report, s, p.name, "tpot")[0] for s in ("loraplex", "engine-alone")]
            dt = t[0] - t[1] if None not in t else None
            ds = 100 * (s_[0] / s_[1] - 1) if None not in s_ else None
            rows.append(f"| {p.name} | {_fmt(t[0], digits=1)} / {_fmt(t[1], digits=1)} / {_fmt(dt, digits=1)} "
                        f"| {_fmt(s_[0])} / {_fmt(s_[1])} / {_fmt(ds, '%', 1)} |")
    return rows


def _row(target: str, value: str, ok: bool | None, why: str = "") -> str:
    verdict = "missing" if ok is None else "met" if ok else "NOT met"
    return f"| {target} | {value if ok is not None else 'missing' + (f' ({why})' if why else '')} | {verdict} |"


def targets_table(report: StackReport, plan: Plan) -> list[str]:
    """Each target against its figure."""
    seed = f"c{plan.workload.concurrency}"
    rows = ["| target | figure | verdict |", "|---|---|---|"]

    def ratio_row(target: str, what: str, num: str, den: str, bound: float, above: bool, goal: float | None = None):
        x, why_x = figure(report, num, seed, what)
        y, why_y = figure(report, den, seed, what)
        if x is None or y is None or not y:
            return _row(target, "", None, why_x or why_y)
        r = x / y
        text = f"{r:.2f}× ({x:.2f} / {y:.2f})" + (f"; goal {goal}×: {'met' if r <= goal else 'not met'}" if goal else "")
        return _row(target, text, r >= bound if above else r <= bound)

    rows.append(ratio_row("(d) decode step (ITL p50) ≤ 1.25× (a) (goal 1.10×)", "itl", "loraplex", "vllm-base", 1.25, False,
                          1.10))
    rows.append(ratio_row("(d) out tok/s per request ≥ 1.5× (b)", "rate", "loraplex", "vllm-lora", 1.5, True))
    rows.append(ratio_row("(d) out tok/s per request ≥ (c)", "rate", "loraplex", "ray-llm", 1.0, True))
    rows.append(ratio_row("(d) TTFT p50 ≤ 1.25× (a)", "ttft", "loraplex", "vllm-base", 1.25, False))
    t = [figure(report, s, seed, "ttft") for s in ("loraplex", "engine-alone")]
    s_ = [figure(report, s, seed, "tpot") for s in ("loraplex", "engine-alone")]
    if t[0][0] is None or t[1][0] is None:
        rows.append(_row("HTTP path adds ≤ 2 ms p50 TTFT over the engine alone", "", None, t[0][1] or t[1][1]))
    else:
        dt = t[0][0] - t[1][0]
        rows.append(_row("HTTP path adds ≤ 2 ms p50 TTFT over the engine alone", f"{dt:+.1f} ms", dt <= 2.0))
    if s_[0][0] is None or s_[1][0] is None or not s_[1][0]:
        rows.append(_row("HTTP path adds ≤ 3% TPOT over the engine alone", "", None, s_[0][1] or s_[1][1]))
    else:
        ds = 100 * (s_[0][0] / s_[1][0] - 1)
        rows.append(_row("HTTP path adds ≤ 3% TPOT over the engine alone", f"{ds:+.1f}%", ds <= 3.0))
    rows.append(cold_row(report, plan))
    rows.append(cliff_row(report, plan))
    return rows


def cold_row(report: StackReport, plan: Plan) -> str:
    target = "cold start (S3 → first token) ≤ 1.5 s"
    d = _system(report, "loraplex")
    colds = [c for c in (d.cold_starts if d else []) if c.cold_ttft_ms is not None and not c.error]
    if not colds:
        why = next((c.error for c in d.cold_starts if c.error), "not measured") if d else "loraplex not in this run"
        return _row(target, "", None, why)
    worst = max(colds, key=lambda c: c.cold_ttft_ms)
    size = f"{worst.adapter_bytes / 2**20:.1f} MiB" if worst.adapter_bytes else "size unknown"
    note = "" if plan.workload.expert_lora else " — attention only, not the target's attention + experts adapter"
    loads = ""
    if worst.disk_load_s is not None or worst.engine_load_s is not None:
        def s(x):
            return "-" if x is None else f"{x:.2f} s"

        loads = (f"; the replica's load: download + verify {s(worst.disk_load_s)}, add_lora {s(worst.add_lora_s)}, "
                 f"miss to add_lora returning {s(worst.engine_load_s)}")
    text = (f"worst {worst.cold_ttft_ms / 1000:.2f} s of {len(colds)} (warm {worst.warm_ttft_ms:.0f} ms; "
            f"adapter rank {plan.workload.rank}, {size}{note}{loads})")
    return _row(target, text, worst.cold_ttft_ms <= 1500.0)


def cliff_row(report: StackReport, plan: Plan) -> str:
    """The largest working set's p99 TTFT against the seed phase's on loraplex."""
    target = "no multi-second TTFT cliff with 64 adapters over 8 slots"
    d = _system(report, "loraplex")
    sets = [p for p in (d.phases if d else []) if p.name.startswith("ws")]
    if not sets:
        return _row(target, "", None, "no working-set phase ran")
    largest = max(len(p.result.spec.adapters) for p in sets)
    base, why = figure(report, "loraplex", f"c{plan.workload.concurrency}", "ttft_p99")
    parts, ok = [], base is not None
    for p in (p for p in sets if len(p.result.spec.adapters) == largest):
        p50, _ = figure(report, "loraplex", p.name, "ttft")
        p99, why_p = figure(report, "loraplex", p.name, "ttft_p99")
        if p99 is None or base is None:
            return _row(target, "", None, why_p or why)
        parts.append(f"{p.result.spec.popularity}: p50 {p50:.0f} / p99 {p99:.0f} ms")
        ok = ok and p99 - base < CLIFF_MS
    shape = f"{largest} adapters over {plan.workload.slots} slots"
    note = "" if (largest, plan.workload.slots) == (64, 8) else " — not the target's 64 over 8"
    return _row(target, f"{shape}{note}: " + "; ".join(parts) + f" (seed phase p99 {base:.0f} ms; a cliff: p99 "
                f"+{CLIFF_MS:.0f} ms or more)", ok)
