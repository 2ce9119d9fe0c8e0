"""Tunes the MoE-LoRA Triton ops per batch-size bucket and writes ``kernels/configs/*.json``.

For each M bucket and each block size BM: the sort (single program, or the parallel two-launch
variant when the rows span several of its chunks) is timed, the faster kept; every shrink config
(block_k, split_k, warps, stages) is timed, the fastest kept; then every expand config (block_n,
warps) on that shrink's partials; the BM with the lowest sum over the four ops plus the sort
wins; then PDL on/off for the whole layer; last, for a naive layout, one fused launch per
projection (``kernels.moe_lora.fused``) against the op pairs. Times are CUDA-graph replays over distinct layers
(weights from HBM), median.

Run on the GPU machine: ``python -m benchmarks.kernels.tune_moe_lora [--model gpt-oss-20b|qwen3-30b-a3b]
[--ms 1,2,4,...] [--layers 16] [--out kernels/configs]``; it merges into the device's file.
``--only fused|align`` keeps the tuned buckets and makes that one choice again.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.kernels.cuda_timing import graph_us as _graph_us
from benchmarks.kernels.cuda_timing import log, tuner_arguments, tuner_run
from benchmarks.shapes import MODELS
from kernels.moe_lora.align import PARALLEL_CHUNK, align_moe_lora
from kernels.moe_lora.configs import (
    CONFIG_DIR,
    OpConfig,
    device_slug,
    dump_layer_config,
    open_config_file,
    parse_layer_config,
    record_run,
    save_config_file,
    shape_key,
)
from kernels.moe_lora.launch import moe_lora_expand, moe_lora_shrink

MS_DEFAULT = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
SHRINK_SPACE = dict(block_k=(64, 128, 256), split_k=(1, 2, 4, 8, 16), num_warps=(4,),
                    num_stages=(2, 3, 4))
EXPAND_SPACE = dict(block_n=(64, 128, 256, 512), num_warps=(4, 8), num_stages=(1,))
# --space small: the full search without the tiles it picked least on the H200 (block_k 64 and
# block_n 64: 3 of the 60 op configs in kernels/configs), a third fewer variants to time
SMALL_SHRINK_SPACE = dict(block_k=(128, 256), split_k=(1, 2, 4, 8, 16), num_warps=(4,),
                          num_stages=(2, 3, 4))
SMALL_EXPAND_SPACE = dict(block_n=(128, 256, 512), num_warps=(4, 8), num_stages=(1,))
SPACES = {"full": (SHRINK_SPACE, EXPAND_SPACE), "small": (SMALL_SHRINK_SPACE, SMALL_EXPAND_SPACE)}


def graph_us(fn, n_layers: int, trials: int = 10) -> float:
    """Median µs per layer of a CUDA graph of ``fn()`` over n_layers layers (fewer trials than
    the benchmark: the tuner times hundreds of variants)."""
    return _graph_us(fn, n_layers, trials)


def space(d: dict) -> list[OpConfig]:
    keys = list(d)
    return [OpConfig(**dict(zip(keys, v))) for v in itertools.product(*d.values())]


def layout_choices(rows: int) -> list[tuple[int, bool]]:
    """(block_m, naive) candidates for a batch of ``rows`` (token, expert) rows."""
    if rows <= 64:
        return [(16, True), (16, False)]
    if rows <= 256:
        return [(16, False)]
    if rows <= 2048:
        return [(16, False), (32, False), (64, False)]
    if rows <= 8192:
        return [(32, False), (64, False)]
    return [(32, False), (64, False), (128, False)]


class Problem:
    """Random stacks for n layers of one model shape, bf16; 8 slots of the given rank."""

    def __init__(self, model: str, n: int, slots: int, rank: int, gen: torch.Generator):
        shape = MODELS[model]
        (self.h, self.i, self.e, self.k), self.s = shape.experts, shape.gate_up_slices
        self.n, self.slots, self.rank = n, slots, rank

        def rnd(shape, std):
            return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(
                0.0, std, generator=gen)

        L, E, r, H, I, S = slots, self.e, rank, self.h, self.i, self.s
        n13 = 2 * I // S
        self.a13 = [tuple(rnd((L, E, r, H), H**-0.5) for _ in range(S)) for _ in range(n)]
        self.b13 = [tuple(rnd((L, E, n13, r), r**-0.5) for _ in range(S)) for _ in range(n)]
        self.a2 = [rnd((L, E, r, I), I**-0.5) for _ in range(n)]
        self.b2 = [rnd((L, E, H, r), r**-0.5) for _ in range(n)]


class Batch:
    """One batch of M tokens for the n layers of ``p``: routing (uniformly random experts), slot
    t % L per token, routing weights, inputs and outputs."""

    def __init__(self, p: Problem, m: int, gen: torch.Generator) -> None:
        dev = torch.device("cuda")
        K = p.k
        self.slot = (torch.arange(m, device=dev) % p.slots).to(torch.int32)
        self.enabled = torch.ones(p.slots, dtype=torch.int32, device=dev)
        self.ids = [torch.rand(m, p.e, device=dev, generator=gen).argsort(dim=1)[:, :K]
                    .to(torch.int32).contiguous() for _ in range(p.n)]
        self.tw = [torch.softmax(torch.randn(m, K, device=dev, generator=gen), -1)
                   for _ in range(p.n)]
        self.x = torch.randn(m, p.h, device=dev, generator=gen).to(torch.bfloat16)
        self.hh = torch.randn(m * K, p.i, device=dev, generator=gen).to(torch.bfloat16)
        self.y13 = torch.zeros(m * K, 2 * p.i, device=dev, dtype=torch.bfloat16)
        self.y2 = torch.zeros(m * K, p.h, device=dev, dtype=torch.bfloat16)


def layer_us(p: Problem, bt: Batch, cfg: dict, pdl: bool) -> float:
    """µs per layer of align + the four ops with the layer config ``cfg``."""
    K = p.k

    def layer():
        out = []
        for l in range(p.n):
            blk = align_moe_lora(bt.ids[l], bt.slot, bt.enabled, p.e, cfg["block_m"],
                                 cfg["naive"], cfg["align_parallel"])
            pt = moe_lora_shrink(bt.x, p.a13[l], blk, K, cfg["shrink13"], use_pdl=pdl)
            moe_lora_expand(bt.y13, pt, p.b13[l], blk, cfg["expand13"], use_pdl=pdl)
            pt = moe_lora_shrink(bt.hh, p.a2[l], blk, 1, cfg["shrink2"], use_pdl=pdl)
            moe_lora_expand(bt.y2, pt, p.b2[l], blk, cfg["expand2"], topk_weights=bt.tw[l],
                            use_pdl=pdl)
            out.append(pt)
        return out

    return graph_us(layer, p.n)


def fused_us(p: Problem, bt: Batch, cfg: dict) -> float:
    """µs per layer with one fused launch per projection (naive layout)."""
    from kernels.moe_lora.fused import moe_lora_fused

    def layer():
        for l in range(p.n):
            blk = align_moe_lora(bt.ids[l], bt.slot, bt.enabled, p.e, cfg["block_m"], True)
            moe_lora_fused(bt.y13, bt.x, p.a13[l], p.b13[l], blk, p.k)
            moe_lora_fused(bt.y2, bt.hh, p.a2[l], p.b2[l], blk, 1, topk_weights=bt.tw[l])
        return bt.y2

    return graph_us(layer, p.n)


def choose_fused(p: Problem, m: int, bt: Batch, cfg: dict, pair_us: float, report: dict
                 ) -> None:
    """Sets ``cfg["fused"]``: one fused launch per projection when it beats the op pairs
    (``pair_us`` per layer) by 3%; naive layouts only."""
    if not cfg["naive"]:
        return
    try:
        report["layer_fused"] = fused = fused_us(p, bt, cfg)
        cfg["fused"] = fused < 0.97 * pair_us
        log(f"M={m}: layer {pair_us:.1f} us as op pairs, {fused:.1f} fused")
    except Exception as exc:
        log(f"M={m}: fused failed: {exc!r}"[:300])


def choose_align(p: Problem, bt: Batch, bm: int, report: dict, tag: str) -> tuple[float, bool]:
    """``(µs per layer, parallel)`` of the faster sort for block size ``bm``: the single
    program, or the two-launch parallel one when the rows span several of its chunks."""
    rows = bt.ids[0].numel()

    def align(parallel: bool):
        return lambda: [align_moe_lora(bt.ids[l], bt.slot, bt.enabled, p.e, bm,
                                       parallel=parallel) for l in range(p.n)]

    t_single = graph_us(align(False), p.n)
    if rows <= PARALLEL_CHUNK:
        return t_single, False
    t_par = graph_us(align(True), p.n)
    report[f"{tag}_align_single"], report[f"{tag}_align_parallel"] = t_single, t_par
    return (t_par, True) if t_par < t_single else (t_single, False)


def tune_m(p: Problem, m: int, gen: torch.Generator, spaces: tuple[dict, dict] = SPACES["full"]
           ) -> tuple[dict, dict]:
    n, K = p.n, p.k
    bt = Batch(p, m, gen)
    slot, enabled, ids, tw = bt.slot, bt.enabled, bt.ids, bt.tw
    x, hh, y13, y2 = bt.x, bt.hh, bt.y13, bt.y2
    best_total, best_cfg, report = float("inf"), None, {}
    for bm, naive in layout_choices(m * K):
        blocks = [align_moe_lora(ids[l], slot, enabled, p.e, bm, naive) for l in range(n)]
        tag = f"bm{bm}{'n' if naive else ''}"
        t_align, parallel = 0.0, False
        if not naive:
            t_align, parallel = choose_align(p, bt, bm, report, tag)
        cfg = {"block_m": bm, "pdl": False, "naive": naive, "align_parallel": parallel}
        total = t_align
        for op, xin, a, b, div, yy, w in (("13", x, p.a13, p.b13, K, y13, None),
                                          ("2", hh, p.a2, p.b2, 1, y2, tw)):
            timed = []
            for c in space(spaces[0]):
                if c.split_k > 1 and c.split_k * c.block_k > xin.shape[1]:
                    continue
                if c.split_k > 2 and m * K > 8192:  # blocks enough to fill the GPU already
                    continue
                try:
                    us = graph_us(lambda: [moe_lora_shrink(xin, a[l], blocks[l], div, c)
                                           for l in range(n)], n)
                except Exception as exc:  # a config the compiler rejects is skipped
                    log(f"  skip shrink{op} {c}: {exc!r}"[:200])
                    continue
                timed.append((us, c))
            us_s, c_s = min(timed, key=lambda t: t[0])
            parts = [moe_lora_shrink(xin, a[l], blocks[l], div, c_s) for l in range(n)]
            timed = []
            for c in space(spaces[1]):
                try:
                    us = graph_us(lambda: [moe_lora_expand(yy, parts[l], b[l], blocks[l], c,
                                                           topk_weights=None if w is None else w[l])
                                           for l in range(n)], n)
                except Exception as exc:
                    log(f"  skip expand{op} {c}: {exc!r}"[:200])
                    continue
                timed.append((us, c))
            us_e, c_e = min(timed, key=lambda t: t[0])
            cfg[f"shrink{op}"], cfg[f"expand{op}"] = c_s, c_e
            total += us_s + us_e
            report[f"{tag}_shrink{op}"], report[f"{tag}_expand{op}"] = us_s, us_e
        report[f"{tag}_align"] = t_align
        report[f"{tag}_total"] = total
        log(f"M={m} BM={bm} naive={naive}: align {t_align:.1f} total {total:.1f} us  {cfg}")
        if total < best_total:
            best_total, best_cfg, best_blocks = total, cfg, blocks
    # PDL on the whole layer (align + 4 ops) with the chosen tiles
    from kernels.lora_tiles import pdl_supported

    if pdl_supported(x):
        try:
            off, on = layer_us(p, bt, best_cfg, False), layer_us(p, bt, best_cfg, True)
            report["layer_pdl_off"], report["layer_pdl_on"] = off, on
            best_cfg["pdl"] = on < 0.97 * off
            log(f"M={m}: layer {off:.1f} us without PDL, {on:.1f} with")
        except Exception as exc:
            log(f"M={m}: PDL failed: {exc!r}"[:300])
    pair = min(report.get("layer_pdl_off", best_total), report.get("layer_pdl_on", best_total))
    choose_fused(p, m, bt, best_cfg, pair, report)
    del best_blocks
    return best_cfg, report


def decide_only(p: Problem, m: int, gen: torch.Generator, cfg: dict, what: str
                ) -> tuple[dict, dict]:
    """The tuned config ``cfg`` of bucket M with one choice made again: ``fused`` (naive
    layouts: one fused launch per projection or the op pairs) or ``align`` (sorted layouts: the
    single-program or the parallel sort)."""
    report: dict = {}
    bt = Batch(p, m, gen)
    if what == "fused" and cfg["naive"]:
        report["layer_pairs"] = pair = layer_us(p, bt, cfg, bool(cfg["pdl"]))
        choose_fused(p, m, bt, cfg, pair, report)
    elif what == "align" and not cfg["naive"]:
        _, cfg["align_parallel"] = choose_align(p, bt, cfg["block_m"], report, "align")
        log(f"M={m}: align {report}")
    return cfg, report


def main(argv: list[str] | None = None) -> int:
    ap = tuner_arguments(__doc__.splitlines()[0], MODELS, MS_DEFAULT, str(CONFIG_DIR))
    ap.add_argument("--space", default="full", choices=sorted(SPACES),
                    help="tile configs to time per op (small: a third fewer)")
    ap.add_argument("--only", choices=("fused", "align"), default=None,
                    help="keep each bucket's tuned config and only make one choice again: "
                         "fused (naive layouts: one fused launch per projection or the op "
                         "pairs) or align (sorted layouts: single-program or parallel sort)")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(4321)
    p = Problem(args.model, args.layers, args.slots, args.rank, gen)
    name = torch.cuda.get_device_name(0)
    key = shape_key(p.h, p.i, p.e, p.k, p.rank, p.slots)
    path = Path(args.out) / f"moe_lora_{device_slug(name)}.json"
    data = open_config_file(path, name, torch.cuda.get_device_capability())
    run = tuner_run(f"python -m benchmarks.kernels.tune_moe_lora --model {args.model} --ms {args.ms} "
                    f"--layers {args.layers} --slots {args.slots} --rank {args.rank} "
                    + (f"--only {args.only}" if args.only else f"--space {args.space}"),
                    args.layers)
    if args.only:
        run["decided"] = args.only  # only this choice was re-made for the buckets
    record_run(data, key, run, [int(v) for v in args.ms.split(",")])
    buckets, reports = data["shapes"].setdefault(key, {}), {}
    t0 = time.time()
    for m in [int(v) for v in args.ms.split(",")]:
        if args.only:
            if str(m) not in buckets:
                log(f"M={m}: no tuned config in {path}: skipped")
                continue
            cfg, rep = decide_only(p, m, gen, parse_layer_config(buckets[str(m)]), args.only)
        else:
            cfg, rep = tune_m(p, m, gen, SPACES[args.space])
        buckets[str(m)] = dump_layer_config(cfg)
        reports[str(m)] = rep
        save_config_file(path, data)
        log(f"[{time.time() - t0:.0f}s] M={m} done -> {path}")
        torch.cuda.empty_cache()
    if args.report:
        Path(args.report).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
