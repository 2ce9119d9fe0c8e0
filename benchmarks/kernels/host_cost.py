"""Host cost of loraplex's LoRA work per layer in an eager step (no CUDA graph), on a GPU.

A step above the CUDA-graph sizes (a new prompt joining running decodes) is issued launch by
launch from Python; where the base model's step is host-bound, every µs the CPU spends issuing
LoRA work lands on the step's critical path. This measures that cost without vLLM: GPT-OSS-20B
shapes, 8 adapter slots, rank 32, one layer's

- MoE expert LoRA as the MXFP4 path runs it (``MoELoRALayer.gate_up`` with the folded swiglu
  and the row map, then ``MoELoRAStep.down``; the complement for rows without expert LoRA,
  which steps whose every token has expert LoRA skip, on its own), and
- dense LoRA of the attention projections (``DenseLoRALayer``: qkv and o),

for token counts that vary from call to call within ``--vary`` (a server's steps differ by a
few decode tokens), tokens on adapters as the serving steady phase has them (one prompt on one
adapter, the rest decode tokens over all slots). Per op: CPU µs to issue one call on an idle
GPU (median over calls, each after a synchronisation: the launch queue never fills, so this is
the host's own cost), and µs per call when the GPU runs them back to back (wall over many
calls, synchronised at the end): a back-to-back time close to the host's means the op is
host-bound.

Run on the GPU machine (torch + Triton; vLLM not needed):
``python -m benchmarks.kernels.host_cost [--ms 16,1615] [--vary 16] [--calls 200]``
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.kernels.cuda_timing import idle_host_us, log
from benchmarks.shapes import GPT_OSS_20B, RANK, SLOTS

(H, I, E, TOPK), R = GPT_OSS_20B.experts, RANK
HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64


def _rnd(gen, *shape, std=1.0):
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, std, generator=gen)


def token_slots(m: int, decodes: int = 15) -> torch.Tensor:
    """``[m]`` int32: the last ``decodes`` tokens over all slots, the prompt's on slot 0."""
    slots = torch.zeros(m, dtype=torch.int32)
    d = min(decodes, m)
    slots[m - d:] = torch.arange(d, dtype=torch.int32) % SLOTS
    return slots.cuda()


def moe_case(m: int, gen) -> tuple:
    """Inputs of one MoE layer call at ``m`` tokens (MXFP4 path: act + row map)."""
    ids = torch.rand(m, E, device="cuda", generator=gen).argsort(dim=1)[:, :TOPK]
    ids = ids.to(torch.int32).contiguous()
    row_map = torch.argsort(ids.reshape(-1), stable=True).argsort().to(torch.int32)
    tw = torch.softmax(torch.randn(m, TOPK, device="cuda", generator=gen), -1)
    x = _rnd(gen, m, H)
    y13 = _rnd(gen, m * TOPK, 2 * I, std=0.1)
    act = torch.empty(m * TOPK, I, dtype=torch.bfloat16, device="cuda")
    y2 = _rnd(gen, m * TOPK, H, std=0.1)
    return ids, row_map.contiguous(), tw, x, y13, act, y2, token_slots(m)


def run(ms: list[int], vary: int, calls: int) -> list[dict]:
    from kernels.dense_lora.groups import group_tokens
    from kernels.dense_lora.layer import DenseLoRALayer
    from kernels.lora_tiles import pdl_supported
    from kernels.moe_lora.activation import swiglu_rows_without_lora
    from kernels.moe_lora.layer import MoELoRALayer

    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = MoELoRALayer(_rnd(gen, SLOTS, E, R, H, std=H**-0.5),
                       _rnd(gen, SLOTS, E, 2 * I, R, std=R**-0.5),
                       _rnd(gen, SLOTS, E, R, I, std=I**-0.5),
                       _rnd(gen, SLOTS, E, H, R, std=R**-0.5), num_experts=E, num_slots=SLOTS)
    enabled = torch.ones(SLOTS, dtype=torch.int32, device="cuda")
    q, kv, hid = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, H
    dense = {"qkv": (hid, [q, kv, kv]), "o": (q, [hid])}
    layers = {name: DenseLoRALayer([_rnd(gen, SLOTS, 1, R, k, std=k**-0.5) for _ in n],
                                   [_rnd(gen, SLOTS, 1, out, R, std=R**-0.5) for out in n])
              for name, (k, n) in dense.items()}
    rows = []
    for m in ms:
        counts = [max(1, m - i) for i in range(vary)]  # a token count per call, as steps have
        cases = [moe_case(c, gen) for c in counts]

        def moe_call(i: int) -> None:  # every token has expert LoRA: no complement
            ids, rmap, tw, x, y13, act, y2, slots = cases[i % len(cases)]
            moe.gate_up(y13, x, ids, slots, enabled, act=act, row_map=rmap).down(y2, act, tw)

        def complement_call(i: int) -> None:
            ids, rmap, _, _, y13, act, _, slots = cases[i % len(cases)]
            swiglu_rows_without_lora(act, y13, ids, slots, enabled, E, row_map=rmap)

        def gate_up_call(i: int) -> None:
            ids, rmap, _, x, y13, act, _, slots = cases[i % len(cases)]
            moe.gate_up(y13, x, ids, slots, enabled, act=act, row_map=rmap)

        ops = {"MoE gate_up": gate_up_call, "MoE gate_up + down": moe_call,
               "MoE complement (steps with tokens without expert LoRA)": complement_call}
        for name, (k, n) in dense.items():
            xs = [_rnd(gen, c, k) for c in counts]
            ys = [torch.zeros(c, sum(n), dtype=torch.bfloat16, device="cuda") for c in counts]
            groups = [group_tokens(cases[j][-1], SLOTS + 1) for j in range(len(counts))]
            layer = layers[name]

            def dense_call(i: int, layer=layer, xs=xs, ys=ys, groups=groups) -> None:
                j = i % len(xs)
                layer(ys[j], xs[j], groups[j], layer.config(xs[j].shape[0]), 1.0, True,
                      pdl_supported(xs[j]))

            ops[f"dense {name}"] = dense_call
        for name, fn in ops.items():
            for i in range(2 * vary):  # compile and keep every variant first
                fn(i)
            host = idle_host_us(fn, calls)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / calls * 1e6
            rows.append({"op": name, "M": m, "vary": vary, "host_us": host, "wall_us": wall})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,1615", help="largest token count of each case")
    ap.add_argument("--vary", type=int, default=16,
                    help="calls cycle through this many token counts, M down to M - vary + 1")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run([int(v) for v in args.ms.split(",")], args.vary, args.calls)
    log(f"\n{torch.cuda.get_device_name()}; µs per eager call of one layer's LoRA work; host: "
        "CPU time to issue it on an idle GPU (median); back to back: wall per call with the GPU "
        "running them")
    log("| op | M | host µs | back to back µs |")
    log("|---|---|---|---|")
    for r in rows:
        log(f"| {r['op']} | {r['M'] - r['vary'] + 1}–{r['M']} | {r['host_us']:.1f} | "
            f"{r['wall_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
