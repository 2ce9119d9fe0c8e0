"""Shape warm-up: one forward of every token-count class before a replica takes traffic.

Triton kernels on the serving path (triton_kernels' MXFP4 GEMMs and routing, the MoE sort)
compile a variant per class of the step's token count: Triton specialises integer arguments on
``== 1`` and ``% 16 == 0``, and the kernels' launch heuristics pick block sizes from the next
power of two of per-expert token counts. vLLM's own warm-up covers the CUDA-graph capture sizes
only, so a mixed step of, say, 1615 tokens compiled in the middle of serving and stalled every
stream of the batch for seconds.

``token_counts(limit)``: for each power of two ``p`` up to ``limit``, ``p``, ``p + 1``, ``p + 2``,
``p + 4`` and ``p + 8`` (each power-of-two class of ``n`` at each launch bucket: the MXFP4 GEMMs
specialise on row counts of ``n`` and ``4n``), one step per class of the MoE routing kernels' integer
arguments (``n``, ``8n``, ``ceil(n / 32)``, ``4 ceil(n / 128)``, each as Triton specialises it:
``== 1``, ``% 16 == 0`` or neither; the smallest such ``n``), and ``limit`` itself. These classes
are what ``benchmarks/profiling/compile_sweep.py`` found compiled after the earlier warm-up of
``p`` and ``p + 1`` only (the keys of the kernels it logs say which argument changed class).
``warm_shapes``
sends one request per count, one at a time, so each engine step holds exactly that many tokens:
a prompt of distinct random token ids (no prefix-cache hit can shorten it) and one output token.
The ids are drawn from the first ``PROMPT_ID_RANGE`` ids, which every tokenizer holds as ordinary
tokens (vLLM refuses ids past the tokenizer's own vocabulary, which can be smaller than the
model's embedding).

With LoRA the same counts run again as one dummy forward each with an adapter in every slot
(``kernels.vllm.worker_extension``): a step with expert LoRA takes other kernels than the base
model's (loraplex's, and the MXFP4 experts unfused, each GEMM and routing variant compiled per
class), so base-model steps alone left those compiles to the first adapter steps of serving.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Any

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)
PROMPT_ID_RANGE = 1000


class ShapeWarmupReport(BaseModel):
    """What a warm-up ran."""

    token_counts: list[int] = Field(description="Tokens of the step each warm-up request made, in order.")
    seconds: list[float] = Field(description="Wall seconds of each request (a compile shows as an outlier).")
    total_s: float = Field(description="Wall seconds of the whole warm-up.")
    limit: int = Field(description="Largest step: the engine's max_num_batched_tokens, capped below max_model_len.")
    lora_active: int = Field(0, description="Dummy adapters active in the LoRA steps (0: none ran).")
    lora_seconds: list[float] = Field(default_factory=list, description="Wall seconds of each LoRA step "
                                      "(same counts, in order), run in the engine's workers.")
    lora_error: str | None = Field(None, description="Why the LoRA steps did not run (None: they ran, or LoRA is off).")


POWER_OFFSETS = (0, 1, 2, 4, 8)


def int_class(x: int) -> str:
    """How Triton specialises an integer argument: ``"1"``, ``"D"`` (a multiple of 16) or ``""``."""
    return "1" if x == 1 else "D" if x % 16 == 0 else ""


def routing_class(n: int) -> tuple[str, ...]:
    """The classes of the routing kernels' integer arguments that derive from a step of ``n`` tokens."""
    return int_class(n), int_class(8 * n), int_class(-(-n // 32)), int_class(4 * -(-n // 128))


def token_counts(limit: int) -> list[int]:
    """Step sizes that cover every token-count class up to ``limit`` (sorted, unique, ≥ 1)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out = {limit}
    p = 1
    while p <= limit:
        out.update(p + d for d in POWER_OFFSETS if p + d <= limit)
        p *= 2
    first_of_class: dict[tuple[str, ...], int] = {}
    for n in range(1, limit + 1):
        first_of_class.setdefault(routing_class(n), n)
    out.update(first_of_class.values())
    return sorted(out)


def step_limit(max_num_batched_tokens: int, max_model_len: int) -> int:
    """Largest prompt that runs as one step and leaves room for its one output token."""
    return max(1, min(max_num_batched_tokens, max_model_len - 1))


def _prompt(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    return [rng.randrange(min(vocab_size, PROMPT_ID_RANGE)) for _ in range(n)]


async def warm_shapes(engine: Any, counts: list[int], vocab_size: int, seed: int = 0) -> tuple[list[float], float]:
    """One base-model request per entry of ``counts`` through ``engine`` (vLLM's ``AsyncLLM``),
    one at a time; returns each request's seconds and the total. Raises what the engine raises."""
    from app.engine.vllm_serving import one_greedy_token

    params = one_greedy_token()
    rng = random.Random(seed)
    seconds: list[float] = []
    t_all = time.perf_counter()
    for n in counts:
        t0 = time.perf_counter()
        request_id = f"loraplex-shape-warmup-{n}-{uuid.uuid4().hex[:8]}"
        async for _ in engine.generate({"prompt_token_ids": _prompt(n, vocab_size, rng)}, params, request_id):
            pass
        seconds.append(time.perf_counter() - t0)
    return seconds, time.perf_counter() - t_all


async def warm_lora_steps(engine: Any, counts: list[int], active: int) -> list[float]:
    """One forward per entry of ``counts`` with ``active`` dummy adapters, in the engine's
    workers (``kernels.vllm.worker_extension``); each forward's seconds (the first worker's)."""
    from kernels.vllm.worker_extension import WARM_LORA_STEPS

    per_worker = await engine.collective_rpc(WARM_LORA_STEPS, args=(counts, active))
    return list(per_worker[0])


async def run(engine: Any, seed: int = 0) -> ShapeWarmupReport:
    """The warm-up for ``engine``'s limits (read through ``app.engine.vllm_serving.engine_limits``)."""
    from app.engine.vllm_serving import engine_limits

    limits = engine_limits(engine)
    limit = step_limit(limits.max_num_batched_tokens, limits.max_model_len)
    counts = token_counts(limit)
    t0 = time.perf_counter()
    seconds, _ = await warm_shapes(engine, counts, limits.vocab_size, seed)
    lora_active, lora_seconds, lora_error = limits.max_loras, [], None
    if lora_active:
        try:
            lora_seconds = await warm_lora_steps(engine, counts, lora_active)
        except Exception as exc:  # noqa: BLE001 - a warm-up only: serving works without it, compiling later
            lora_error = f"{type(exc).__name__}: {exc}"[:500]
            logger.warning("shape warm-up: the LoRA steps failed (%s); kernels of the LoRA path will compile "
                           "while serving", lora_error)
    total = time.perf_counter() - t0
    report = ShapeWarmupReport(token_counts=counts, seconds=[round(s, 4) for s in seconds], total_s=round(total, 3),
                               limit=limit, lora_active=lora_active if lora_seconds else 0,
                               lora_seconds=[round(s, 4) for s in lora_seconds], lora_error=lora_error)
    slowest = max(range(len(counts)), key=seconds.__getitem__)
    logger.info("shape warm-up: %d steps of 1..%d tokens in %.2f s (slowest: %d tokens, %.2f s); "
                "LoRA steps with %d adapters: %.2f s", len(counts), limit, total, counts[slowest], seconds[slowest],
                report.lora_active, sum(lora_seconds))
    return report
