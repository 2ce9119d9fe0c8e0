"""The Triton MXFP4 experts' steps in each row layout, side by side (GPU with vLLM 0.24).

Why: with LoRA on, the MXFP4 experts cannot fuse the activation into the w13 GEMM (the LoRA
delta goes in before it), so the engine runs the GEMMs unfused; the decode step profile shows
those GEMMs 0.44 ms per step slower than the LoRA-off engine's fused ones, besides the separate
activation and top-k sum. This times every piece per MoE layer (CUDA-graph replay over
``--layers`` weight copies, so weights stream from HBM as in the engine):

- routing: vLLM's ``make_routing_data`` from top-k ids, ``kernels.mxfp4.routing``'s, and
  triton_kernels' ``routing`` from router logits (the LoRA-off engine's; it includes the top-k,
  which the LoRA engine's router computes before the experts, ~2 µs per layer);
- w13 GEMM: *fused* (swiglu in the epilogue, expert-sorted rows: LoRA off), *sorted* (unfused,
  expert-sorted rows: vLLM's unfused class), *pair* (unfused, token gather + scatter to
  token-pair rows: loraplex's pair-order apply);
- w2 GEMM: *reduce* (sorted input, top-k sum in the GEMM's scatter: LoRA off), *pair* (gathers
  pair rows, pair-row output: loraplex), *sorted* (sorted input, pair-row output);
- the separate swiglu and ``moe_sum`` kernels.

The layers then add up: LoRA off = logits routing + fused + reduce; loraplex's pair order =
loraplex routing + pair w13 + swiglu + pair w2 + moe_sum; a sorted-row variant = loraplex
routing + sorted w13 + swiglu + sorted w2 + moe_sum. The pair-order layer's output is checked
against the LoRA-off layer's (relative error; bf16 rounding differs only in the order of sums).

``python -m benchmarks.kernels.mxfp4_experts [--ms 16,1600,8192] [--layers 8]``
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.shapes import GPT_OSS_20B

HIDDEN, INTER, EXPERTS, TOP_K = GPT_OSS_20B.experts


def mxfp4_experts(n: int, k: int, seed: int):
    """Random MXFP4 experts ``[E, k, n]`` (codes and power-of-two scales near 1) in the layout
    and precision config vLLM's MXFP4 method gives ``matmul_ogs``; float32 bias ``[E, n]``."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4

    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda",
                          generator=g)
    scales = torch.randint(118, 123, (EXPERTS, n, k // 32), dtype=torch.uint8, device="cuda",
                           generator=g)
    w, flex, scale = _swizzle_mxfp4(codes, scales)
    bias = torch.randn(EXPERTS, n, device="cuda", generator=g) * 0.01
    return w, PrecisionConfig(weight_scale=scale, flex_ctx=FlexCtx(rhs_data=flex)), bias


def expert_layers(count: int) -> list[tuple]:
    """``count`` random MoE layers' experts ``(w13, p13, b13, w2, p2, b2)``."""
    return [(*mxfp4_experts(2 * INTER, HIDDEN, 2 * i), *mxfp4_experts(HIDDEN, INTER, 2 * i + 1))
            for i in range(count)]


def router_topk(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [m, K] int32, weights [m, K] float32)``: the top-k of random router scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = torch.topk(torch.randn(m, EXPERTS, device="cuda", generator=g).softmax(-1), TOP_K)
    return ids.int(), w


def sorted_row_inputs(m: int, seed: int):
    """One step's GEMM inputs of the sorted-row path for ``m`` tokens: ``(x [m, H] bf16,
    routing (top-k), gather, scatter, routing with one output row per pair)`` from random
    router scores (loraplex's routing)."""
    from kernels.mxfp4.routing import routing_data

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    routing, gather, scatter = routing_data(*router_topk(m, seed + 1), EXPERTS)
    return x, routing, gather, scatter, dataclasses.replace(routing, n_expts_act=1)


def layer_steps(m: int, layers: list, seed: int = 0) -> tuple[dict, float]:
    """``{step: fn}`` running one step over every layer of ``layers`` (w13, p13, b13, w2, p2,
    b2), and the pair-order layer's relative error against the LoRA-off layer."""
    import triton_kernels.swiglu
    from triton_kernels.matmul_ogs import (
        FnSpecs,
        FusedActivation,
        GatherIndx,
        matmul_ogs,
    )
    from triton_kernels.routing import routing as logits_routing
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import (
        make_routing_data,
    )

    from kernels.mxfp4.routing import routing_data

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(m, EXPERTS, device="cuda", generator=g).bfloat16()
    weights, ids = torch.topk(torch.softmax(logits.float(), -1), TOP_K)
    weights, ids = weights / weights.sum(-1, keepdim=True), ids.int()
    route_k, gather, scatter = make_routing_data(ids, weights, EXPERTS)
    route_1 = dataclasses.replace(route_k, n_expts_act=1)
    token_gather = GatherIndx(src_indx=torch.div(gather.src_indx, TOP_K, rounding_mode="trunc"),
                              dst_indx=gather.dst_indx)
    swiglu = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn,
                                     ("alpha", "limit")), (1.702, 7.0), 2)
    rows = m * TOP_K
    bufs = {name: torch.empty(1, r, c, device="cuda", dtype=torch.bfloat16) for name, r, c in (
        ("act_sorted", rows, INTER), ("act_pair", rows, INTER), ("y13", rows, 2 * INTER),
        ("y2", rows, HIDDEN), ("out", m, HIDDEN), ("out_pair", m, HIDDEN))}
    b = {k: v.view(v.shape[1], v.shape[2]) for k, v in bufs.items()}

    def w13(layer, out, **kw):
        return matmul_ogs(x, layer[0], layer[2], precision_config=layer[1], y=out, **kw)

    def w2(layer, x2, route, out, **kw):
        return matmul_ogs(x2, layer[3], layer[5], route, precision_config=layer[4],
                          gammas=route.gate_scal, scatter_indx=scatter, y=out, **kw)

    per_layer = {  # step name -> fn(layer)
        "routing vLLM": lambda _: make_routing_data(ids, weights, EXPERTS),
        "routing loraplex": lambda _: routing_data(ids, weights, EXPERTS),
        "routing logits": lambda _: logits_routing(logits, TOP_K),
        "w13 fused": lambda ly: w13(ly, bufs["act_sorted"], routing_data=route_k,
                                    gather_indx=gather, fused_activation=swiglu),
        "w13 sorted": lambda ly: w13(ly, bufs["y13"], routing_data=route_k, gather_indx=gather),
        "w13 pair": lambda ly: w13(ly, bufs["y13"], routing_data=route_1,
                                   gather_indx=token_gather, scatter_indx=scatter),
        "swiglu": lambda _: torch.ops._C.swigluoai_and_mul(b["act_pair"], b["y13"], 1.702, 7.0),
        "w2 reduce": lambda ly: w2(ly, b["act_sorted"], route_k, bufs["out"]),
        "w2 pair": lambda ly: w2(ly, b["act_pair"], route_1, bufs["y2"], gather_indx=gather),
        "w2 sorted": lambda ly: w2(ly, b["act_sorted"], route_1, bufs["y2"]),
        "moe_sum": lambda _: ops.moe_sum(b["y2"].view(m, TOP_K, HIDDEN), b["out_pair"]),
    }
    # the first layer both ways: LoRA off (fused, reduce), pair order (pair, swiglu, pair, sum)
    for name in ("w13 fused", "w2 reduce", "w13 pair", "swiglu", "w2 pair", "moe_sum"):
        per_layer[name](layers[0])
    off, pair = b["out"].float(), b["out_pair"].float()
    err = float((pair - off).norm() / off.norm().clamp_min(1e-30))
    steps = {name: (lambda fn=fn: [fn(layer) for layer in layers])
             for name, fn in per_layer.items()}
    return steps, err


LAYERS = {"LoRA off": ("routing logits", "w13 fused", "w2 reduce"),
          "pair order (loraplex)": ("routing loraplex", "w13 pair", "swiglu", "w2 pair",
                                    "moe_sum"),
          "pair order, vLLM routing": ("routing vLLM", "w13 pair", "swiglu", "w2 pair",
                                       "moe_sum"),
          "sorted rows": ("routing loraplex", "w13 sorted", "swiglu", "w2 sorted", "moe_sum")}


def main(argv: list[str] | None = None) -> int:
    from vllm.utils.import_utils import import_triton_kernels

    from benchmarks.kernels.cuda_timing import graph_us

    import_triton_kernels()  # site-packages' triton_kernels, else vLLM's bundled copy
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,1600,8192", help="tokens per step")
    ap.add_argument("--layers", type=int, default=8, help="weight copies per timed graph")
    args = ap.parse_args(argv)
    layers = expert_layers(args.layers)
    print(f"GPT-OSS-20B MoE layer ({EXPERTS} experts, top-{TOP_K}), MXFP4 weights; µs per "
          f"layer, CUDA-graph replay over {args.layers} weight copies, median of 20", flush=True)
    results = []
    for m in (int(v) for v in args.ms.split(",")):
        steps, err = layer_steps(m, layers)
        us = {name: graph_us(fn, len(layers)) for name, fn in steps.items()}
        results.append((m, us, err))
    names = list(results[0][1])
    print("\n| M | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for m, us, _ in results:
        print(f"| {m} | " + " | ".join(f"{us[n]:.1f}" for n in names) + " |")
    print("\n| M | " + " | ".join(LAYERS) + " | pair-order output vs LoRA off (rel. err) |")
    print("|---|" + "---|" * (len(LAYERS) + 1))
    for m, us, err in results:
        off = sum(us[n] for n in LAYERS["LoRA off"])
        cells = [f"{sum(us[n] for n in parts):.1f} ({sum(us[n] for n in parts) / off:.2f}×)"
                 for parts in LAYERS.values()]
        print(f"| {m} | " + " | ".join(cells) + f" | {err:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
