"""Where a prefill step's time goes with adapters: CUDA kernel time per family, on a GPU.

One vLLM 0.24 engine in this process, as served (torch.compile, CUDA graphs, loraplex's plugin
as the environment switches it), GPT-OSS-20B shape with balanced random weights
(``benchmarks.gpt_oss_dummy``; ``--mxfp4`` for MXFP4 experts), LoRA enabled with ``--adapters``
rank-32 adapters on attention + experts. The same prompts (``--prompts`` × ``--prompt-len``
tokens, one output token: prefill steps of up to ``max_num_batched_tokens`` tokens, beyond the
CUDA-graph sizes, so every kernel is visible to the profiler) run twice under
``torch.profiler``: every request with an adapter, then none. Kernels are grouped into families
(``kernel_family``); the table gives milliseconds of kernel time per family for both passes and
the difference, i.e. what the adapters add to the step and which part of the stack adds it.

Run on the GPU machine (vLLM 0.24 importable, repository root on ``PYTHONPATH``):
``python -m benchmarks.gpu_step_profile [--mxfp4] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict

from benchmarks.gpt_oss_dummy import (adapter_requests, add_run_args, in_process_engine_env,
                                      lora_engine, random_prompts, use_balanced_dummy_weights,
                                      write_adapters, write_model_dir)

# (family, pattern on the kernel name), first match wins
FAMILIES = [
    ("MoE-LoRA (loraplex)", r"_moe_lora_(align|shrink|expand)_kernel"),
    ("MoE-LoRA (vLLM)", r"fused_moe_lora|moe_lora_align"),
    ("dense LoRA (vLLM punica)", r"_lora_(shrink|expand)|sgmv|bgmv"),
    ("MoE base GEMMs", r"fused_moe_kernel|matmul_ogs|_matmul|marlin|moe_wna16"),
    ("MoE routing / sums", r"topk|moe_sum|moe_align|routing|bitmatrix|gather|scatter|swiglu|silu"),
    ("attention", r"flash|fmha|attn|attention"),
    ("dense GEMMs", r"gemm|cutlass|xmma|nvjet|sm90|cublas"),
]


def kernel_family(name: str) -> str:
    """The family of a CUDA kernel name (``other`` when none matches)."""
    low = name.lower()
    for family, pattern in FAMILIES:
        if re.search(pattern, low):
            return family
    return "other"


def family_ms(events) -> dict[str, float]:
    """Milliseconds of kernel time per family over ``torch.profiler`` events: only device-side
    events (the kernels themselves; CPU ops' totals would count their kernels again)."""
    out: dict[str, float] = defaultdict(float)
    for ev in events:
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            out[kernel_family(ev.name)] += (ev.device_time_total or 0.0) / 1e3
    return dict(out)


def profile_pass(llm, prompts, loras) -> tuple[dict[str, float], float]:
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(reqs, sp, lora_request=loras, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return family_ms(prof.events()), wall * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, adapters=8, prompt_len=1600)
    args = ap.parse_args()

    in_process_engine_env()
    use_balanced_dummy_weights()
    model = write_model_dir(args.workdir, args.mxfp4)
    paths = write_adapters(f"{args.workdir}/adapters", args.adapters, 32, 0.002)
    llm = lora_engine(model, args.adapters, 32, eager=False, max_model_len=4096)
    prompts = random_prompts(args.prompts, args.prompt_len)
    loras = adapter_requests(paths, args.prompts)
    for lr in (loras, None):  # warm: adapters resident, every kernel compiled
        profile_pass(llm, prompts, lr)
    with_ad, wall_with = profile_pass(llm, prompts, loras)
    without, wall_without = profile_pass(llm, prompts, None)

    names = sorted(set(with_ad) | set(without), key=lambda f: -with_ad.get(f, 0.0))
    tokens = args.prompts * args.prompt_len
    print(f"\nGPT-OSS-20B shape, {'MXFP4' if args.mxfp4 else 'bf16'} experts, {tokens} prompt "
          f"tokens in steps of <= 8192, {args.adapters} adapters r32; kernel ms per pass")
    print("| family | with adapters | without | added |")
    print("|---|---|---|---|")
    for f in names:
        a, b = with_ad.get(f, 0.0), without.get(f, 0.0)
        print(f"| {f} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    ta, tb = sum(with_ad.values()), sum(without.values())
    print(f"| all kernels | {ta:.2f} | {tb:.2f} | {ta - tb:+.2f} |")
    print(f"| wall time of the pass | {wall_with:.2f} | {wall_without:.2f} | "
          f"{wall_with - wall_without:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "with_adapters_ms": with_ad, "without_ms": without,
                       "wall_ms": {"with": wall_with, "without": wall_without}}, f, indent=1)


if __name__ == "__main__":
    main()
