"""Which step sizes still compile a Triton kernel after loraplex's shape warm-up, and why.

    python3 -m benchmarks.profiling.compile_sweep SERVE_CONFIG --adapters DIR [--json OUT]

Starts the engine of SERVE_CONFIG's loraplex engine section in process (as the engine alone of
``benchmarks.gpu_stack`` does: ``engine_from_config``), runs the replica's shape warm-up, loads 8
adapters of DIR (its first 8 adapter folders, sorted; or DIR itself, one adapter, under 8 names),
then probes one step size at a time: a request of ``n`` prompt tokens and one output token as the
base model, the same with one adapter, and ``n`` tokens split over 8 requests of 8 adapters sent
together (one step of ``n`` tokens, 8 adapters active, as a served batch has them). After each
probe the engine worker's compile list (``kernels.vllm.worker_extension``'s ``loraplex_compiles``)
says what it compiled: kernel, ms, Triton's specialisation key. The keys say which argument
classes the warm-up's step sizes miss: the summary names, for each compile, the positions where
its key differs from the nearest variant of the same kernel the warm-ups compiled (kept in the
JSON as ``warmup_compiles``).

Step sizes: every ``n`` up to 40, and per power-of-two bucket ``(p/2, p]`` up to the engine's one-step
limit its top ``p`` and ``p - d`` for ``d`` in ``OFFSETS``, plus ``--random`` sizes drawn uniformly.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

OFFSETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31, 33, 48)
KINDS = ("base", "one adapter", "8 adapters")
SLOTS = 8


class Compile(BaseModel):
    """One Triton compile seen after a probe."""

    kernel: str
    ms: float = Field(description="Compile wall time (NaN where the pre-compile hook did not see it).")
    key: str = Field(description="Triton's specialisation key (argument classes, constants, options).")


class Probe(BaseModel):
    """One step size of one kind, and what it compiled."""

    kind: str = Field(description="One of KINDS.")
    tokens: int = Field(description="Tokens of the step.")
    seconds: float = Field(description="Wall seconds of the probe's requests.")
    compiles: list[Compile] = Field(default_factory=list)


class SweepReport(BaseModel):
    """The whole sweep."""

    warmup_counts: list[int] = Field(description="Step sizes of the shape warm-up.")
    warmup_s: float
    warmup_compiles: list[Compile] = Field(default_factory=list, description="Compiled from the MoE-LoRA kernels' "
                                           "warm-up to the end of the shape warm-up: the variants warmed.")
    adapter_load_compiles: list[Compile] = Field(default_factory=list, description="Compiled by the adapters' loads.")
    probes: list[Probe] = Field(default_factory=list)


def key_items(key: str) -> list:
    """A Triton specialisation key (``str`` of a list of tuples) as a list; ``[key]`` when it
    does not parse."""
    try:
        items = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        return [key]
    return list(items) if isinstance(items, (list, tuple)) else [items]


def nearest_warmed(compile: Compile, warmed: list[Compile]) -> tuple[int, list[tuple[int, Any, Any]]] | None:
    """The warmed variant of the same kernel whose key differs from ``compile``'s in the fewest
    positions: ``(its index in warmed, [(position, warmed item, this item), ...])``; None when
    the kernel was not warmed. Positions past the shorter key count as differences (None on its side)."""
    mine = key_items(compile.key)
    best = None
    for i, w in enumerate(warmed):
        if w.kernel != compile.kernel:
            continue
        diff = [(j, a, b) for j, (a, b) in enumerate(itertools.zip_longest(key_items(w.key), mine)) if a != b]
        if best is None or len(diff) < len(best[1]):
            best = (i, diff)
    return best


def step_sizes(limit: int, extra_random: int, seed: int = 0) -> list[int]:
    """The probed step sizes, sorted, within ``1..limit``."""
    sizes = set(range(1, min(40, limit) + 1))
    p = 64
    while p // 2 < limit:
        top = min(p, limit)
        sizes.update(top - d for d in (0, *OFFSETS) if top - d > p // 2)
        p *= 2
    rng = random.Random(seed)
    sizes.update(rng.randint(1, limit) for _ in range(extra_random))
    return sorted(sizes)


def adapter_folders(path: Path, error) -> dict[str, Path]:
    """8 adapters by name: the first 8 adapter folders in ``path`` (sorted), or ``path`` itself 8
    times under 8 names when it is one adapter folder (the kernels depend on shapes, not weights)."""
    if (path / "adapter_config.json").is_file():
        return {f"{path.name}-{i}": path for i in range(SLOTS)}
    folders = sorted(p for p in path.iterdir() if (p / "adapter_config.json").is_file())[:SLOTS]
    if len(folders) < SLOTS:
        error(f"{path} holds {len(folders)} adapter folders; {SLOTS} are needed (or give one adapter folder)")
    return {p.name: p for p in folders}


async def compiles_so_far(engine: Any) -> list[Compile]:
    from kernels.vllm.worker_extension import COMPILES

    got = (await engine.collective_rpc(COMPILES))[0]
    ours = [Compile(kernel=name, ms=float("nan"), key="") for name in got["ours"]]
    return ours + [Compile(kernel=k, ms=round(s * 1e3, 1), key=key) for k, s, key in got["other"]]


async def generate(engine: Any, ids: list[int], lora: Any = None) -> None:
    from app.engine.vllm_serving import one_greedy_token

    async for _ in engine.generate({"prompt_token_ids": ids}, one_greedy_token(), f"sweep-{uuid.uuid4().hex[:12]}",
                                   lora_request=lora):
        pass


async def probe(engine: Any, kind: str, n: int, loras: list[Any], rng: random.Random, vocab: int) -> float:
    """Sends ``kind``'s requests for a step of ``n`` tokens; wall seconds."""
    def prompt(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    t0 = time.perf_counter()
    if kind == "base":
        await generate(engine, prompt(n))
    elif kind == "one adapter":
        await generate(engine, prompt(n), loras[0])
    else:
        parts = [n // len(loras) + (1 if i < n % len(loras) else 0) for i in range(len(loras))]
        await asyncio.gather(*(generate(engine, prompt(k), lora) for k, lora in zip(parts, loras) if k))
    return time.perf_counter() - t0


async def sweep(serve_config: Path, adapters: dict[str, Path], extra_random: int, kinds: list[str]) -> SweepReport:
    from app.engine import shape_warmup
    from app.engine.vllm_serving import engine_limits
    from benchmarks.gpu_stack_parts.serve_config import engine_config
    from benchmarks.loadgen.engine_target import engine_from_config, lora_requests

    cfg = engine_config(yaml.safe_load(serve_config.read_text()))
    engine = engine_from_config(cfg)
    try:
        t0 = time.perf_counter()
        warm = await shape_warmup.run(engine, cfg.seed)
        report = SweepReport(warmup_counts=warm.token_counts, warmup_s=round(time.perf_counter() - t0, 2))
        limits = engine_limits(engine)
        vocab = min(limits.vocab_size, shape_warmup.PROMPT_ID_RANGE)
        loras = list(lora_requests(adapters).values())
        rng = random.Random(1)
        report.warmup_compiles = await compiles_so_far(engine)
        seen = len(report.warmup_compiles)
        await asyncio.gather(*(generate(engine, [rng.randrange(vocab) for _ in range(16)], lora) for lora in loras))
        now = await compiles_so_far(engine)
        report.adapter_load_compiles, seen = now[seen:], len(now)
        sizes = step_sizes(shape_warmup.step_limit(limits.max_num_batched_tokens, limits.max_model_len), extra_random)
        for kind in kinds:
            for n in sizes:
                if kind == "8 adapters" and n < len(loras):
                    continue
                s = await probe(engine, kind, n, loras, rng, vocab)
                now = await compiles_so_far(engine)
                report.probes.append(Probe(kind=kind, tokens=n, seconds=round(s, 4), compiles=now[seen:]))
                seen = len(now)
                for c in report.probes[-1].compiles:
                    print(f"{kind:>12} n={n:<5} {c.kernel.rsplit('.', 1)[-1]:<34} {c.ms:7.0f} ms  key {c.key[:300]}",
                          flush=True)
        return report
    finally:
        engine.shutdown()


def summary(report: SweepReport) -> str:
    lines = [f"warm-up: {len(report.warmup_counts)} step sizes in {report.warmup_s} s; adapter loads compiled "
             f"{len(report.adapter_load_compiles)} kernels"]
    for kind in KINDS:
        probes = [p for p in report.probes if p.kind == kind]
        if not probes:
            continue
        hit = [p for p in probes if p.compiles]
        lines.append(f"{kind}: {len(probes)} step sizes probed, {len(hit)} compiled something "
                     f"({sum(len(p.compiles) for p in hit)} kernels, "
                     f"{sum(c.ms for p in hit for c in p.compiles if c.ms == c.ms) / 1e3:.1f} s): "
                     + ", ".join(str(p.tokens) for p in hit))
        for p in hit:
            for c in p.compiles:
                near = nearest_warmed(c, report.warmup_compiles)
                what = ("no variant of it was warmed" if near is None else
                        f"the nearest warmed variant differs at {len(near[1])} key position(s): " + "; ".join(
                            f"[{j}] warmed {a!r}, here {b!r}" for j, a, b in near[1][:6]))
                lines.append(f"  n={p.tokens} {c.kernel.rsplit('.', 1)[-1]}: {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("serve_config", type=Path)
    ap.add_argument("--adapters", type=Path, required=True,
                    help="A folder of PEFT adapter folders (the first 8 used), or one adapter folder (used 8 times).")
    ap.add_argument("--random", type=int, default=60, help="Further step sizes drawn uniformly.")
    ap.add_argument("--kinds", default=",".join(KINDS), help="Comma-separated subset of: " + ", ".join(KINDS))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}")
    report = asyncio.run(sweep(a.serve_config, adapter_folders(a.adapters, ap.error), a.random, kinds))
    print(summary(report))
    if a.json:
        a.json.write_text(json.dumps(report.model_dump(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
