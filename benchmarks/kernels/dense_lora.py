"""Benchmark: loraplex's dense LoRA ops vs vLLM 0.24's punica ``add_lora_linear`` on one GPU.

GPT-OSS-20B attention and router shapes: qkv (in 2880, slices 4096 / 512 / 512), o (in 4096,
out 2880), router (in 2880, out 32); 8 adapter slots of rank 32, bf16; M tokens, token t on slot
t % 8. Both sides read the same per-step metadata (``LoRAKernelMeta.prepare_tensors``) and are
called through ``add_lora_linear`` of vLLM's ``PunicaWrapperGPU`` and of loraplex's subclass
(``kernels.vllm.cuda.punica``), as the engine calls them.

Columns: GPU µs per layer (CUDA-graph replays over ``--layers`` distinct layers, weights from
HBM, median), and host µs per call (eager calls issued back to back, CPU time to issue one:
what a prefill step, which runs without CUDA graphs, pays per layer on the CPU). ``%cp``: LoRA
weight bytes of the slots in use / GPU time against the measured copy bandwidth.

Run on the GPU machine: ``python -m benchmarks.kernels.dense_lora [--ms 1,16,64,256,1616,8192]``
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.kernels.cuda_timing import graph_us, log
from benchmarks.kernels.moe_lora import copy_bandwidth_tbs, rel
from benchmarks.shapes import GPT_OSS_20B

SHAPES = GPT_OSS_20B.dense_ops()
SLOTS, RANK = 8, 32


def random_stacks(n_layers: int, k: int, slices, gen, slots: int = SLOTS, rank: int = RANK):
    """``n_layers`` layers' (A per slice ``[L, 1, r, k]``, B per slice ``[L, 1, n, r]``) in
    bf16 on the GPU, random (std 1/sqrt(fan-in))."""
    def rnd(*shape, std):
        return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, std,
                                                                             generator=gen)
    return [(tuple(rnd(slots, 1, rank, k, std=k**-0.5) for _ in slices),
             tuple(rnd(slots, 1, n, rank, std=rank**-0.5) for n in slices))
            for _ in range(n_layers)]


def host_us(fn, calls: int = 50) -> float:
    """CPU µs to issue one eager call (back to back, no sync in between)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def profile_calls(fn, path: str, calls: int = 200) -> None:
    """``calls`` eager calls of ``fn`` under ``cProfile``; raw stats written to ``path``."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    prof.dump_stats(path)


def fused_columns(row: dict, outs: dict, layers, x, y, lora, n_layers: int,
                  block_ns: list[int]) -> None:
    """loraplex's one-launch form (``cfg.fused``) at each output tile in ``block_ns``, through
    ``DenseLoRALayer`` on the same layers and tokens: ``fused<N>_us`` (GPU µs per layer) and
    ``fused<N>_err`` (relative error against vLLM's output) added to ``row``."""
    from dataclasses import replace

    from kernels.dense_lora.groups import group_tokens
    from kernels.dense_lora.launch import fused_form
    from kernels.dense_lora.layer import DenseLoRALayer

    groups = group_tokens(lora, SLOTS + 1)
    dense_layers = [DenseLoRALayer(a, b) for a, b in layers]
    ref = outs["vllm"]
    for bn in block_ns:
        cfg = replace(fused_form(dense_layers[0].config(int(x.shape[0]))), block_n=bn)

        def all_layers(cfg=cfg):
            for layer in dense_layers:
                layer(y, x, groups, cfg)
            return y

        y.zero_()
        dense_layers[0](y, x, groups, cfg)
        row[f"fused{bn}_err"] = rel(y.float(), ref)
        row[f"fused{bn}_us"] = graph_us(all_layers, n_layers)


def run_case(name: str, m: int, n_layers: int, wrappers: dict, gen, copy_tbs: float,
             pstats_dir: str | None = None, fused_block_ns: list[int] | None = None) -> dict:
    """``wrappers``: ``{"vllm": PunicaWrapperGPU, "ours": LoraplexPunicaWrapper}`` instances;
    ``fused_block_ns``: also the fused form at these output tiles (``fused_columns``)."""
    from kernels.vllm import cuda

    k, slices = SHAPES[name]
    layers = random_stacks(n_layers, k, slices, gen)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
    y = torch.zeros(m, sum(slices), dtype=torch.bfloat16, device="cuda")
    lora = torch.arange(m, device="cuda", dtype=torch.int32) % SLOTS
    row = {"op": name, "M": m}
    outs = {}
    for side, pw in wrappers.items():
        pw.token_mapping_meta.prepare_tensors(lora)

        def all_layers(pw=pw):
            for a, b in layers:
                pw.add_lora_linear(y, x, a, b, 1.0, slices)
            return y

        def one_layer(pw=pw):
            pw.add_lora_linear(y, x, *layers[0], 1.0, slices)

        if side == "ours":
            cuda.install()
        try:
            y.zero_()
            one_layer()
            outs[side] = y.float().clone()
            row[f"{side}_us"] = graph_us(all_layers, n_layers)
            row[f"{side}_host_us"] = host_us(one_layer)
            if pstats_dir:
                profile_calls(one_layer, os.path.join(pstats_dir, f"{name}_{m}_{side}.pstats"))
        finally:
            cuda.uninstall()
    used = min(m, SLOTS)
    weight_bytes = used * RANK * (len(slices) * k + sum(slices)) * 2
    row["speedup"] = row["vllm_us"] / row["ours_us"]
    row["ours_cp"] = 100 * weight_bytes / (row["ours_us"] * 1e-6) / (copy_tbs * 1e12)
    ref = outs["vllm"]
    row["rel_err_vs_vllm"] = rel(outs["ours"], ref)
    if fused_block_ns:
        fused_columns(row, outs, layers, x, y, lora, n_layers, fused_block_ns)
    return row


def main(argv: list[str] | None = None) -> int:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from kernels.vllm.cuda.punica import LoraplexPunicaWrapper

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,64,256,1616,8192")
    ap.add_argument("--ops", default="qkv,o,router")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fused", default="", metavar="BLOCK_NS",
                    help="also loraplex's one-launch form at these output tiles (e.g. 128,512)")
    ap.add_argument("--pstats-dir", default=None,
                    help="also profile 200 eager calls per case and side (cProfile) into here")
    args = ap.parse_args(argv)
    fused_block_ns = [int(v) for v in args.fused.split(",") if v]
    if args.pstats_dir:
        os.makedirs(args.pstats_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_tbs = copy_bandwidth_tbs()
    config = LoRAConfig(max_lora_rank=RANK, max_loras=SLOTS)
    wrappers = {side: cls(8192, 256, torch.device("cuda"), lora_config=config)
                for side, cls in (("vllm", PunicaWrapperGPU), ("ours", LoraplexPunicaWrapper))}
    rows = []
    for name in args.ops.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            rows.append(run_case(name, m, args.layers, wrappers, gen, copy_tbs, args.pstats_dir,
                                 fused_block_ns))
            log(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                            for k, v in rows[-1].items()}))
    log(f"\ncopy bandwidth {copy_tbs:.2f} TB/s; µs per layer (GPU: CUDA-graph replay; host: "
        f"CPU time to issue one eager call)")
    log("| op | M | vLLM GPU | ours GPU | speed-up | ours %cp | vLLM host | ours host | "
        "rel. err vs vLLM |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['op']} | {r['M']} | {r['vllm_us']:.1f} | {r['ours_us']:.1f} | "
            f"**{r['speedup']:.2f}×** | {r['ours_cp']:.0f} | {r['vllm_host_us']:.1f} | "
            f"{r['ours_host_us']:.1f} | {r['rel_err_vs_vllm']:.1e} |")
    if fused_block_ns:
        log("\nthe one-launch form (fused) against the pair (ours), GPU µs per layer; rel. err "
            "vs vLLM")
        log("| op | M | ours GPU | " + " | ".join(f"fused {bn} GPU | ×" for bn in fused_block_ns)
            + " | max rel. err |")
        log("|---|---|---|" + "---|---|" * len(fused_block_ns) + "---|")
        for r in rows:
            cells = [f"{r[f'fused{bn}_us']:.1f} | {r['ours_us'] / r[f'fused{bn}_us']:.2f}×"
                     for bn in fused_block_ns]
            err = max(r[f"fused{bn}_err"] for bn in fused_block_ns)
            log(f"| {r['op']} | {r['M']} | {r['ours_us']:.1f} | " + " | ".join(cells)
                + f" | {err:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbs": copy_tbs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
