"""Host cost of the MXFP4 experts' routing and two GEMM calls: vLLM's / triton_kernels' against
loraplex's (``kernels.mxfp4.sort``, ``kernels.launch.kept_matmul_ogs``) side by side (GPU, vLLM 0.24).

Why: a prefill step of the MXFP4 engine is host-bound, and the sorted-row path sorts the
routing and calls ``matmul_ogs`` twice per MoE layer. This times the CPU cost of issuing each
call on an idle GPU
(synchronised before each call; median over ``--calls`` calls alternating between two layers'
weights), for the w13 GEMM (token gather into expert-sorted rows) and the w2 GEMM (pair scatter
with the routing weights), at each token count, and checks that both give the same output
(routing: the same gather indices).

``python -m benchmarks.kernels.mxfp4_host [--ms 16,1615] [--calls 200]``
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.cuda_timing import idle_host_us


def routing_calls(ids, weights, experts: int, calls: int) -> tuple[float, float, float]:
    """Host µs of vLLM's ``make_routing_data`` and loraplex's ``routing_data`` for the same
    top-k, and 0 if their gather indices are equal (1 otherwise)."""
    from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import (
        make_routing_data,
    )

    from kernels.mxfp4.routing import routing_data

    theirs, ours = make_routing_data(ids, weights, experts), routing_data(ids, weights, experts)
    same = torch.equal(theirs[1].src_indx, ours[1].src_indx)
    return (idle_host_us(lambda _: make_routing_data(ids, weights, experts), calls),
            idle_host_us(lambda _: routing_data(ids, weights, experts), calls),
            0.0 if same else 1.0)


def main(argv: list[str] | None = None) -> int:
    from vllm.utils.import_utils import import_triton_kernels

    import_triton_kernels()
    from triton_kernels.matmul_ogs import matmul_ogs

    from benchmarks.kernels.mxfp4_experts import (
        EXPERTS,
        HIDDEN,
        INTER,
        TOP_K,
        expert_layers,
        router_topk,
        sorted_row_inputs,
    )
    from kernels.launch.kept_matmul_ogs import KeptMatmulOgs, kept_matmul_ogs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,1615", help="tokens per call")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    kept = kept_matmul_ogs(matmul_ogs)
    if not isinstance(kept, KeptMatmulOgs):
        raise SystemExit("kept launches do not apply to this matmul_ogs")
    layers = expert_layers(2)
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        x, route_k, gather, scatter, route_1 = sorted_row_inputs(m, seed=m)
        g = torch.Generator(device="cuda").manual_seed(m)
        y13 = torch.empty(1, m * TOP_K, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        act = torch.randn(m * TOP_K, INTER, device="cuda", generator=g).bfloat16()
        y2 = torch.empty(1, m * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
        t0 = routing_calls(*router_topk(m, m), EXPERTS, args.calls)
        rows.append(("routing (sort by expert)", m, *t0))
        calls = {
            "w13 (gather to sorted rows)": lambda fn, ly: fn(
                x, ly[0], ly[2], route_k, gather_indx=gather, precision_config=ly[1], y=y13),
            "w2 (pair scatter, weights)": lambda fn, ly: fn(
                act, ly[3], ly[5], route_1, scatter_indx=scatter, precision_config=ly[4],
                gammas=route_1.gate_scal, y=y2),
        }
        for name, run in calls.items():
            out = y13 if name.startswith("w13") else y2
            run(matmul_ogs, layers[0])
            want = out.clone()
            run(kept, layers[0])  # recorded
            run(kept, layers[0])  # kept
            diff = float((out.float() - want.float()).abs().max())
            us = {}
            for label, fn in (("matmul_ogs", matmul_ogs), ("kept", kept)):
                us[label] = idle_host_us(lambda i, fn=fn: run(fn, layers[i % 2]), args.calls)
            rows.append((name, m, us["matmul_ogs"], us["kept"], diff))
    print(f"MXFP4 experts' routing and GEMM calls, GPT-OSS-20B shapes ({EXPERTS} experts, "
          f"top-{TOP_K}); host µs per call on an idle GPU, median of {args.calls}")
    print("\n| call | tokens | vLLM / triton_kernels µs | loraplex µs | × | max abs diff |")
    print("|---|---|---|---|---|---|")
    for name, m, a, b, diff in rows:
        print(f"| {name} | {m} | {a:.1f} | {b:.1f} | {a / b:.1f} | {diff:.3g} |")
    print(f"\nkept launcher calls: {kept.counts}; recorded calls not kept, by reason: "
          f"{kept.refusals or None}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
