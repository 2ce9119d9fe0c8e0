"""Where a step's time goes with adapters: CUDA kernel time per family and per kernel, on a GPU.

One vLLM 0.24 engine in this process, as served (torch.compile, CUDA graphs, loraplex's plugin
as the environment switches it), GPT-OSS-20B shape with balanced random weights
(``benchmarks.gpt_oss_dummy``; ``--mxfp4`` for MXFP4 experts), LoRA enabled with ``--adapters``
rank-32 adapters on attention + experts. Two workloads, each run under ``torch.profiler`` with
every request on an adapter, then on none:

- *prefill*: ``--prompts`` prompts of ``--prompt-len`` tokens, one per step (the step a new
  request brings while serving; beyond the CUDA-graph sizes, so torch.compile's graphs run
  eagerly);
- *decode*: ``--prompts`` requests of 32 tokens decoding ``--decode-steps`` tokens together
  (CUDA graphs; the profiler sees the kernels inside them).

Tables: milliseconds of kernel time per step per family (``kernel_family``) with and without
adapters and the difference, the wall time per step, and the kernels that add the most.

Run on the GPU machine (vLLM 0.24 importable, repository root on ``PYTHONPATH``):
``python -m benchmarks.gpu_step_profile [--mxfp4] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
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
    ("dense LoRA (loraplex)", r"_dense_lora_(shrink|expand)_kernel"),
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


def kernel_ms(events) -> dict[str, tuple[float, int]]:
    """Milliseconds and launches per CUDA kernel name over ``torch.profiler`` events: only
    device-side events (the kernels themselves; CPU ops' totals would count their kernels
    again)."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            out[ev.name][0] += (ev.device_time_total or 0.0) / 1e3
            out[ev.name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def family_ms(events) -> dict[str, float]:
    """Milliseconds of kernel time per family (``kernel_family``) over ``torch.profiler``
    events."""
    out: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernel_ms(events).items():
        out[kernel_family(name)] += ms
    return dict(out)


def run_batches(llm, batches, max_tokens: int, loras: bool, paths) -> float:
    """Runs ``batches`` (lists of prompts, one ``generate`` call each; request i of batch b on
    adapter (b + i) % adapters when ``loras``); wall ms to the last kernel's end."""
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b, prompts in enumerate(batches):  # batch b starts on adapter b (rotates)
        lr = adapter_requests(paths, b + len(prompts))[b:] if loras else None
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=lr,
                     use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profile_pass(llm, batches, max_tokens: int, loras: bool, paths) -> tuple[dict, float]:
    """``run_batches`` under the CUDA profiler: (per-kernel ms, wall ms)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = run_batches(llm, batches, max_tokens, loras, paths)
    return kernel_ms(prof.events()), wall


def print_tables(title: str, steps: int, with_k: dict, without_k: dict, walls, top: int) -> dict:
    """Family table and the ``top`` kernels by added time, in ms per step; returns the figures."""
    fam_with, fam_without = defaultdict(float), defaultdict(float)
    for src, dst in ((with_k, fam_with), (without_k, fam_without)):
        for name, (ms, _) in src.items():
            dst[kernel_family(name)] += ms / steps
    print(f"\n{title}; ms per step ({steps} steps)")
    print("| family | with adapters | without | added |")
    print("|---|---|---|---|")
    for f in sorted(set(fam_with) | set(fam_without), key=lambda f: -fam_with.get(f, 0.0)):
        a, b = fam_with.get(f, 0.0), fam_without.get(f, 0.0)
        print(f"| {f} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    ta, tb = sum(fam_with.values()), sum(fam_without.values())
    wa, wb = walls[0] / steps, walls[1] / steps
    print(f"| all kernels | {ta:.3f} | {tb:.3f} | {ta - tb:+.3f} |")
    print(f"| wall time | {wa:.3f} | {wb:.3f} | {wa - wb:+.3f} |")
    added = {n: with_k.get(n, (0.0, 0))[0] - without_k.get(n, (0.0, 0))[0]
             for n in set(with_k) | set(without_k)}
    print(f"\ntop {top} kernels by time added per step (launches per step with / without)")
    print("| kernel | with | without | added | launches |")
    print("|---|---|---|---|---|")
    for n in sorted(added, key=lambda n: -abs(added[n]))[:top]:
        a, b = with_k.get(n, (0.0, 0)), without_k.get(n, (0.0, 0))
        print(f"| `{n[:90]}` | {a[0] / steps:.3f} | {b[0] / steps:.3f} | "
              f"{added[n] / steps:+.3f} | {a[1] / steps:.1f} / {b[1] / steps:.1f} |")
    return {"steps": steps, "families_with": dict(fam_with), "families_without":
            dict(fam_without), "wall_ms_per_step": [wa, wb],
            "kernels_with": with_k, "kernels_without": without_k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, adapters=8, prompt_len=1600)
    ap.add_argument("--decode-steps", type=int, default=128,
                    help="decode phase: --prompts requests of 32 tokens, this many new tokens")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also profile the prefill passes' Python (host) time: top N functions")
    ap.add_argument("--cprofile-dir", default=None,
                    help="with --cprofile: also write the raw stats (pstats files) here")
    args = ap.parse_args()

    in_process_engine_env()
    use_balanced_dummy_weights()
    model = write_model_dir(args.workdir, args.mxfp4)
    paths = write_adapters(f"{args.workdir}/adapters", args.adapters, 32, 0.002)
    llm = lora_engine(model, args.adapters, 32, eager=False, max_model_len=4096)
    label = f"GPT-OSS-20B shape, {'MXFP4' if args.mxfp4 else 'bf16'} experts, {args.adapters} " \
            f"adapters r32"
    # prefill: one prompt per step (the step a new request brings while serving)
    prefill = [[p] for p in random_prompts(args.prompts, args.prompt_len)]
    decode = [random_prompts(args.prompts, 32, seed=1)]
    report = {"args": vars(args)}
    for name, batches, max_tokens, steps in (
            ("prefill", prefill, 1, len(prefill)),
            ("decode", decode, args.decode_steps + 1, args.decode_steps)):
        for lr in (True, False):  # warm: adapters resident, every kernel compiled
            profile_pass(llm, batches, max_tokens, lr, paths)
        with_k, wall_with = profile_pass(llm, batches, max_tokens, True, paths)
        without_k, wall_without = profile_pass(llm, batches, max_tokens, False, paths)
        title = (f"{label}: prefill, one {args.prompt_len}-token prompt per step" if
                 name == "prefill" else
                 f"{label}: decode, {args.prompts} requests (+ one small prefill step)")
        report[name] = print_tables(title, steps, with_k, without_k, (wall_with, wall_without),
                                    args.top)
    if args.cprofile:
        report["host"] = host_profile(llm, prefill, paths, args.cprofile, args.cprofile_dir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def host_profile(llm, batches, paths, top: int, dump_dir: str | None = None) -> dict:
    """The prefill passes (with adapters, then none) under ``cProfile``: where the host's time
    goes in a step that runs without CUDA graphs. Prints the top functions by own time and by
    cumulative time; ``dump_dir``: also the raw stats, ``prefill_{with,without}.pstats``."""
    import cProfile
    import io
    import pstats

    out = {}
    for label, loras in (("with adapters", True), ("without", False)):
        prof = cProfile.Profile()
        prof.enable()
        run_batches(llm, batches, 1, loras, paths)
        prof.disable()
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            prof.dump_stats(os.path.join(dump_dir, f"prefill_{label.split()[0]}.pstats"))
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
            print(f"\nhost profile, prefill {label} ({len(batches)} steps), by {order}:")
            print("\n".join(buf.getvalue().splitlines()[-top - 3:]))
            out[f"{label}, {order}"] = buf.getvalue()
    return out


if __name__ == "__main__":
    main()
