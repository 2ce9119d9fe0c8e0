"""Tunes the dense LoRA Triton ops per layer shape and batch-size bucket and writes
``kernels/configs/dense_lora_<device>.json`` (read by ``kernels.dense_lora.configs``).

Per shape (a model's attention qkv and o projections) and M bucket: for each row block
(``block_m``) and warp count, every shrink tile (``block_k`` x ``split_k``) is timed alone, then
every expand tile (``block_n``) on the fastest shrink's partials; the (block_m, warps) pair with
the lowest shrink + expand wins. Also timed: the heuristic ``dense_config``, so the table shows
what tuning gained. Times are CUDA-graph replays over ``--layers`` distinct layers (weights from
HBM), median, µs per layer; token t on slot t % slots, as in ``benchmarks.kernels.dense_lora``.

Run on the GPU machine: ``python -m benchmarks.kernels.tune_dense_lora [--model gpt-oss-20b|qwen3-30b-a3b]
[--ms 1,4,16,...] [--ops qkv,o]``; it merges into the device's file (commit it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.shapes import MODELS as SHAPES
from kernels.dense_lora.configs import PREFIX, dense_shape_key, dump_dense_config
from kernels.dense_lora.launch import DenseLoRAConfig, dense_config

# op -> (input features, output features per slice), per model
MODELS = {name: {op: s.dense_ops()[op] for op in ("qkv", "o")} for name, s in SHAPES.items()}
MS_DEFAULT = "1,4,16,64,256,1024,2048,4096,8192"
BLOCK_KS, SPLIT_KS, BLOCK_NS, WARPS = (64, 128, 256), (1, 2, 4, 8, 16), (64, 128, 256), (4, 8)

# timer(kind, cfg) -> µs per layer; kind "shrink" (alone) or "expand" (on cfg's shrink partials)
Timer = Callable[[str, DenseLoRAConfig], float]


def block_ms(m: int) -> tuple[int, ...]:
    """Row-block candidates for ``m`` tokens (spread over up to 8 slot groups)."""
    if m <= 64:
        return (16,)
    if m <= 1024:
        return (16, 32, 64)
    return (32, 64, 128)


def shrink_tiles(in_features: int) -> list[tuple[int, int]]:
    """``(block_k, split_k)`` pairs whose split parts hold at least one K tile."""
    return [(bk, sk) for bk in BLOCK_KS for sk in SPLIT_KS if bk * sk <= in_features]


def tune_bucket(m: int, in_features: int, timer: Timer) -> tuple[DenseLoRAConfig, dict]:
    """The fastest config for ``m`` tokens (module docstring) and the timings behind it."""
    report: dict = {}
    best: tuple[float, DenseLoRAConfig] | None = None
    for bm in block_ms(m):
        for warps in WARPS:
            us_s, bk, sk = min((timer("shrink", DenseLoRAConfig(bm, bk, sk, 128, warps)), bk, sk)
                               for bk, sk in shrink_tiles(in_features))
            us_e, bn = min((timer("expand", DenseLoRAConfig(bm, bk, sk, bn, warps)), bn)
                           for bn in BLOCK_NS)
            cfg = DenseLoRAConfig(bm, bk, sk, bn, warps)
            report[f"bm{bm}_w{warps}"] = {"shrink_us": us_s, "expand_us": us_e,
                                          "config": asdict(cfg)}
            if best is None or us_s + us_e < best[0]:
                best = (us_s + us_e, cfg)
    report["tuned_us"] = best[0]
    return best[1], report


def gpu_timer(in_features: int, outs: tuple[int, ...], m: int, n_layers: int, slots: int,
              rank: int, gen: torch.Generator) -> Timer:
    """``Timer`` of one shape and M on the current CUDA device: random stacks for ``n_layers``
    layers, ``m`` random tokens on slots t % slots."""
    from benchmarks.kernels.cuda_timing import graph_us
    from benchmarks.kernels.dense_lora import random_stacks
    from kernels.dense_lora.groups import group_tokens
    from kernels.dense_lora.launch import dense_lora_expand, dense_lora_shrink
    from kernels.lora_tiles import pdl_supported

    layers = random_stacks(n_layers, in_features, outs, gen, slots, rank)
    x = torch.randn(m, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.zeros(m, sum(outs), dtype=torch.bfloat16, device="cuda")
    groups = group_tokens(torch.arange(m, device="cuda", dtype=torch.int32) % slots, slots + 1)
    pdl = pdl_supported(x)

    def shrinks(cfg):
        return [dense_lora_shrink(x, a, groups, cfg, use_pdl=pdl) for a, _ in layers]

    def timer(kind: str, cfg: DenseLoRAConfig) -> float:
        if kind == "shrink":
            return graph_us(lambda: shrinks(cfg), n_layers, trials=10)
        parts = shrinks(cfg)
        return graph_us(lambda: [dense_lora_expand(y, p, b, groups, cfg, True, use_pdl=pdl)
                                 for p, (_, b) in zip(parts, layers)], n_layers, trials=10)

    return timer


def main(argv: list[str] | None = None) -> int:
    from benchmarks.kernels.cuda_timing import log, tuner_arguments, tuner_run
    from kernels.moe_lora.configs import (
        CONFIG_DIR,
        device_slug,
        open_config_file,
        record_run,
        save_config_file,
    )

    ap = tuner_arguments(__doc__.splitlines()[0], MODELS, MS_DEFAULT, str(CONFIG_DIR))
    ap.add_argument("--ops", default=None, help="default: all of the model's (qkv,o)")
    args = ap.parse_args(argv)

    gen = torch.Generator(device="cuda").manual_seed(4321)
    name = torch.cuda.get_device_name(0)
    path = Path(args.out) / f"{PREFIX}_{device_slug(name)}.json"
    data = open_config_file(path, name, torch.cuda.get_device_capability())
    ops = args.ops.split(",") if args.ops else list(MODELS[args.model])
    ms = [int(v) for v in args.ms.split(",")]
    run = tuner_run(f"python -m benchmarks.kernels.tune_dense_lora --model {args.model} --ops {','.join(ops)} "
                    f"--ms {args.ms} --layers {args.layers} --slots {args.slots} "
                    f"--rank {args.rank}", args.layers)
    reports, rows, t0 = {}, [], time.time()
    for op in ops:
        k, outs = MODELS[args.model][op]
        key = dense_shape_key(k, outs, args.rank, args.slots)
        record_run(data, key, run, ms)
        buckets = data["shapes"].setdefault(key, {})
        for m in ms:
            timer = gpu_timer(k, outs, m, args.layers, args.slots, args.rank, gen)
            cfg, rep = tune_bucket(m, k, timer)
            heuristic = dense_config(m, k, len(outs))
            rep["heuristic_us"] = timer("shrink", heuristic) + timer("expand", heuristic)
            buckets[str(m)] = dump_dense_config(cfg)
            reports[f"{op}/{m}"] = rep
            rows.append((op, m, rep["heuristic_us"], rep["tuned_us"], cfg))
            save_config_file(path, data)
            log(f"[{time.time() - t0:.0f}s] {op} M={m}: heuristic {rep['heuristic_us']:.1f} µs, "
                f"tuned {rep['tuned_us']:.1f} µs {asdict(cfg)} -> {path}")
            torch.cuda.empty_cache()
    log("\n| op | M | heuristic µs | tuned µs | gain | block_m | block_k | split_k | block_n "
        "| warps |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for op, m, h, t, c in rows:
        log(f"| {op} | {m} | {h:.1f} | {t:.1f} | {h / t:.2f}× | {c.block_m} | {c.block_k} | "
            f"{c.split_k} | {c.block_n} | {c.num_warps} |")
    if args.report:
        Path(args.report).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
