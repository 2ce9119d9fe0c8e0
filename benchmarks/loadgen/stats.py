"""Latency percentiles and the figures of a phase over its successful requests."""

from __future__ import annotations

import math
from collections import Counter

from benchmarks.loadgen.spec import Percentiles, PhaseAggregate, RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (a percentage) of non-empty ``values``."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise(values: list[float]) -> Percentiles | None:
    """Mean and ``PERCENTILES`` of ``values`` (None when empty)."""
    if not values:
        return None
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return Percentiles(mean=sum(values) / len(values), p50=p50, p90=p90, p99=p99)


def aggregate(records: list[RequestRecord], wall_s: float) -> PhaseAggregate:
    """The phase's figures over its successful requests."""
    ok = [r for r in records if r.ok]
    rates = [r.tokens_per_s for r in ok if r.tokens_per_s is not None]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return PhaseAggregate(
        requests=len(records), failures=len(records) - len(ok),
        token_mismatches=sum(r.output_tokens != r.expected_output_tokens for r in ok),
        multi_token_chunk_requests=sum(r.max_chunk_tokens > 1 for r in ok), wall_s=wall_s,
        ttft_ms=summarise([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        itl_ms=summarise([x for r in ok for x in r.itl_ms]),
        tpot_ms=summarise([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        e2e_ms=summarise([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        tokens_per_s_per_request=sum(rates) / len(rates) if rates else None,
        output_throughput_tok_s=sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        mean_output_tokens=sum(r.output_tokens for r in ok) / len(ok) if ok else None,
        errors=dict(Counter(str(r.status) for r in records if not r.ok)),
    )
