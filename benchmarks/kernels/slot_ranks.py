"""Benchmark: MoE-LoRA ops for adapters of rank r held in slots of a larger rank (vLLM sizes its
stacks for ``max_lora_rank`` and zeroes them past each adapter's rank).

Three ways side by side, GPT-OSS-20B expert shape, 8 slots, bf16, gate_up + down of one layer:

- ``whole``: the ops read every slot's whole stack (rank R, zeros past r): what they did before
  reading slot ranks, and what vLLM's own kernels do;
- ``ranked``: the same stacks, each slot read up to its adapter's rank (``MoELoRABlocks.
  slot_ranks``: what loraplex's engines run);
- ``exact``: stacks of rank r (an engine whose ``max_lora_rank`` is the adapters' rank): the
  floor ``ranked`` should reach.

Times are CUDA-graph replays over ``--layers`` distinct layers (weights come from HBM), median
per layer. ``err``: ``ranked``'s and ``exact``'s deltas against ``whole``'s. Torch and Triton
only (no vLLM).

``python -m benchmarks.kernels.slot_ranks [--ms 1,16,64,256] [--adapter-rank 32]
[--slot-rank 64] [--layers 16] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.kernels.cuda_timing import graph_us, log
from benchmarks.shapes import GPT_OSS_20B, SLOTS

(H, I, E, TOPK), NL = GPT_OSS_20B.experts, SLOTS
WAYS = ("whole", "ranked", "exact")


def stacks(n: int, rank: int, slot_rank: int, gen: torch.Generator) -> list[tuple]:
    """``n`` layers of ``(a13, b13, a2, b2)`` with ``slot_rank`` rows / columns, random up to
    ``rank`` and zero past it."""
    def rnd(shape, std, rank_dim):
        t = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        t.narrow(rank_dim, 0, rank).normal_(0.0, std, generator=gen)
        return t

    return [(rnd((NL, E, slot_rank, H), H**-0.5, 2), rnd((NL, E, 2 * I, slot_rank), rank**-0.5, 3),
             rnd((NL, E, slot_rank, I), I**-0.5, 2), rnd((NL, E, H, slot_rank), rank**-0.5, 3))
            for _ in range(n)]


def run_m(m: int, big: list, small: list, rank: int, gen: torch.Generator) -> dict:
    from kernels.moe_lora.ops import MoELoRAOps

    n, dev = len(big), torch.device("cuda")
    slot = (torch.arange(m, device=dev) % NL).to(torch.int32)
    ids = [torch.rand(m, E, device=dev, generator=gen).argsort(dim=1)[:, :TOPK]
           .to(torch.int32).contiguous() for _ in range(n)]
    tw = [torch.softmax(torch.randn(m, TOPK, device=dev, generator=gen), -1) for _ in range(n)]
    x = torch.randn(m, H, device=dev, generator=gen).to(torch.bfloat16)
    h = torch.randn(m * TOPK, I, device=dev, generator=gen).to(torch.bfloat16)
    flags = torch.ones(NL, dtype=torch.int32, device=dev)
    ranks = torch.full((NL,), rank, dtype=torch.int32, device=dev)
    slot_rank = big[0][0].shape[2]
    setups = {
        "whole": (big, [MoELoRAOps(ids[i], slot, flags, E, H, I, slot_rank, NL) for i in range(n)]),
        "ranked": (big, [MoELoRAOps(ids[i], slot, ranks, E, H, I, slot_rank, NL, slot_ranks=True)
                         for i in range(n)]),
        "exact": (small, [MoELoRAOps(ids[i], slot, flags, E, H, I, rank, NL) for i in range(n)]),
    }
    y13 = {w: torch.zeros(m * TOPK, 2 * I, dtype=torch.bfloat16, device=dev) for w in WAYS}
    y2 = {w: torch.zeros(m * TOPK, H, dtype=torch.bfloat16, device=dev) for w in WAYS}

    def layers(way: str):
        lay, ops = setups[way]
        for i in range(n):
            a13, b13, a2, b2 = lay[i]
            ops[i].add_w13(y13[way], x, a13, b13)
            ops[i].add_w2(y2[way], h, a2, b2, tw[i])

    res: dict = {"M": m, "us": {}, "err": {}}
    for way in WAYS:  # layer 0's deltas, for the comparison
        lay, ops = setups[way]
        ops[0].add_w13(y13[way], x, lay[0][0], lay[0][1])
        ops[0].add_w2(y2[way], h, lay[0][2], lay[0][3], tw[0])
    torch.cuda.synchronize()
    res["delta_norm"] = float(y2["whole"].double().norm())  # the compared deltas are not 0
    for way in ("ranked", "exact"):
        res["err"][way] = max(
            float((got[way].double() - got["whole"].double()).norm()
                  / got["whole"].double().norm().clamp_min(1e-30)) for got in (y13, y2))
    for way in WAYS:
        res["us"][way] = graph_us(lambda: layers(way), n)
    res["ranked_vs_whole"] = res["us"]["whole"] / res["us"]["ranked"]
    res["ranked_vs_exact"] = res["us"]["ranked"] / res["us"]["exact"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--adapter-rank", type=int, default=32)
    ap.add_argument("--slot-rank", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 0 < args.adapter_rank <= args.slot_rank:
        ap.error("--adapter-rank must be positive and at most --slot-rank")
    import triton

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "layers": args.layers, "adapter_rank": args.adapter_rank,
            "slot_rank": args.slot_rank, "shape": dict(H=H, I=I, E=E, top_k=TOPK, slots=NL)}
    log(json.dumps(info))
    gen = torch.Generator(device="cuda").manual_seed(1234)
    big = stacks(args.layers, args.adapter_rank, args.slot_rank, gen)
    small = [tuple(t.narrow(d, 0, args.adapter_rank).contiguous()
                   for t, d in zip(lay, (2, 3, 2, 3))) for lay in big]
    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        rows.append(run_m(m, big, small, args.adapter_rank, gen))
        log(json.dumps(rows[-1]))
    info["rows"] = rows
    log(f"\nrank-{args.adapter_rank} adapters in rank-{args.slot_rank} slots, gate_up + down, "
        "CUDA-graph µs per layer (median)")
    log(f"{'M':>5} | {'whole':>8}{'ranked':>8}{'exact':>8} | {'whole/ranked':>13}"
        f"{'ranked/exact':>13} | {'err ranked':>11}{'err exact':>10}")
    for r in rows:
        t = r["us"]
        log(f"{r['M']:>5} | {t['whole']:>8.1f}{t['ranked']:>8.1f}{t['exact']:>8.1f} | "
            f"{r['ranked_vs_whole']:>13.2f}{r['ranked_vs_exact']:>13.2f} | "
            f"{r['err']['ranked']:>11.1e}{r['err']['exact']:>10.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
