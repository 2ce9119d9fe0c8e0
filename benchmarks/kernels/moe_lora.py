"""Benchmark: loraplex's MoE-LoRA Triton ops vs vLLM 0.24's ``fused_moe_lora`` on one GPU.

GPT-OSS-20B expert shape (hidden 2880, expert intermediate 2880, 32 experts, top-4), 8 adapter
slots of rank 32 (the 3-D MoE layout: one gate_up slice), bf16; M tokens in 1..1024, token t
uses slot t % 8, each token's 4 experts drawn uniformly at random (distinct).

vLLM is called the way its ``TritonExperts.apply`` does (``PunicaWrapperGPU.add_lora_w13`` /
``add_lora_w2``: tile config lookup, ``moe_lora_align_block_size``, the fused shrink+expand
kernel). Ours: ``align`` + shrink + expand for gate_up, shrink + expand for down.

Times are CUDA-graph replays of the op over ``--layers`` distinct layers (distinct weights and
routing, several GB, so weights come from HBM), median replay / layers. Bytes an op must read,
against a measured device-to-device copy (read + write counted, as for the copy itself):
``%cp`` counts the LoRA weights of the distinct (adapter, expert) pairs only; ``%cpA`` adds the
activations the op must read as well — the input rows (``x [M, H]`` for gate_up, ``h [M*K, I]``
for down), the rank-r intermediate (bf16, once) and, for the expand's fused add, the output rows
it adds to (``[M*K, 2I]`` / ``[M*K, H]``); what the ops write is not counted.

Run on the GPU machine (vLLM 0.24 importable, project on PYTHONPATH):
``python -m benchmarks.kernels.moe_lora [--ms 1,4,16,64,256,1024] [--layers 32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from benchmarks.kernels.cuda_timing import graph_us, log
from benchmarks.shapes import GPT_OSS_20B, RANK, SLOTS

(H, I, E, TOPK), NL, R = GPT_OSS_20B.experts, SLOTS, RANK


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second, in TB/s."""
    from triton.testing import do_bench

    n = 2**30
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e12


class Layers:
    """Random LoRA stacks and routing for ``n`` layers, GPT-OSS-20B shape."""

    def __init__(self, n: int, gen: torch.Generator) -> None:
        def rnd(shape, std):
            return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(
                0.0, std, generator=gen)

        self.n = n
        self.a13 = [rnd((NL, E, R, H), H**-0.5) for _ in range(n)]
        self.b13 = [rnd((NL, E, 2 * I, R), R**-0.5) for _ in range(n)]
        self.a2 = [rnd((NL, E, R, I), I**-0.5) for _ in range(n)]
        self.b2 = [rnd((NL, E, H, R), R**-0.5) for _ in range(n)]
        self.w1 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device="cuda")
        self.w2 = torch.empty((E, H, I), dtype=torch.bfloat16, device="cuda")


def run_m(m: int, lay: Layers, gen: torch.Generator, pw, copy_tbs: float) -> dict:
    from kernels.moe_lora.launch import moe_lora_expand, moe_lora_shrink
    from kernels.moe_lora.ops import MoELoRAOps

    n = lay.n
    dev = torch.device("cuda")
    slot = (torch.arange(m, device=dev) % NL).to(torch.int32)
    pw.token_mapping_meta.prepare_tensors(slot)
    enabled = torch.zeros(NL + 1, dtype=torch.int32, device=dev)
    enabled[:NL] = 1
    ids = [torch.rand(m, E, device=dev, generator=gen).argsort(dim=1)[:, :TOPK]
           .to(torch.int32).contiguous() for _ in range(n)]
    tw = [torch.softmax(torch.randn(m, TOPK, device=dev, generator=gen), -1) for _ in range(n)]
    x = torch.randn(m, H, device=dev, generator=gen).to(torch.bfloat16)
    h = torch.randn(m * TOPK, I, device=dev, generator=gen).to(torch.bfloat16)
    y13 = (0.1 * torch.randn(m * TOPK, 2 * I, device=dev, generator=gen)).to(torch.bfloat16)
    y2 = (0.1 * torch.randn(m * TOPK, H, device=dev, generator=gen)).to(torch.bfloat16)

    def v13(l):
        return pw.add_lora_w13(y13, x, (lay.a13[l],), (lay.b13[l],), ids[l], tw[l], None,
                               lay.w1, lay.w2, m, TOPK, NL, enabled, E, TOPK, 1, False, False)

    def v2(l, meta):
        pw.add_lora_w2(y2.view(m, TOPK, H), h, (lay.a2[l],), (lay.b2[l],), tw[l], meta[0],
                       meta[1], meta[2], meta[3], m, lay.w1, lay.w2, TOPK, NL, enabled, TOPK,
                       False, 0, False)

    ops = [MoELoRAOps(ids[l], slot, enabled[:NL], E, H, I, R, NL) for l in range(n)]
    cfg = ops[0].cfg

    # ---- correctness, layer 0: ours and vLLM's deltas vs a float32 torch reference ----
    keys = slot.long().repeat_interleave(TOPK) * E + ids[0].reshape(-1).long()
    rows_tok = torch.arange(m, device=dev).repeat_interleave(TOPK)
    d13 = torch.zeros(m * TOPK, 2 * I, device=dev)
    d2 = torch.zeros(m * TOPK, H, device=dev)
    for key in keys.unique().tolist():
        sel = (keys == key).nonzero().squeeze(1)
        a, e = divmod(key, E)
        d13[sel] = (x[rows_tok[sel]].float() @ lay.a13[0][a, e].float().t()) @ lay.b13[0][a, e].float().t()
        d2[sel] = ((h[sel].float() @ lay.a2[0][a, e].float().t()) @ lay.b2[0][a, e].float().t()
                   * tw[0].reshape(-1)[sel, None])
    res = {"M": m, "config": {k: (v.__dict__ if hasattr(v, "__dict__") else v) for k, v in cfg.items()}}
    for name, f13, f2 in (("ours", lambda: ops[0].add_w13(y13, x, lay.a13[0], lay.b13[0]),
                           lambda: ops[0].add_w2(y2, h, lay.a2[0], lay.b2[0], tw[0])),
                          ("vllm", lambda: v13(0), None)):
        y13_in, y2_in = y13.clone(), y2.clone()
        meta = f13()
        if name == "ours":
            f2()
        else:
            v2(0, meta)
        torch.cuda.synchronize()
        res[f"err13_{name}"] = rel(y13.float() - y13_in.float(), d13)
        res[f"err2_{name}"] = rel(y2.float() - y2_in.float(), d2)
        y13.copy_(y13_in)
        y2.copy_(y2_in)

    # ---- bytes ----
    pairs = statistics.mean(
        int((slot.long().repeat_interleave(TOPK) * E + ids[l].reshape(-1).long()).unique().numel())
        for l in range(n))
    res["pairs"] = pairs
    by = {"s13": pairs * R * H * 2, "e13": pairs * 2 * I * R * 2,
          "s2": pairs * R * I * 2, "e2": pairs * H * R * 2}
    by["w13"] = by["s13"] + by["e13"]
    by["w2"] = by["s2"] + by["e2"]
    res["bytes"] = by
    rows = m * TOPK  # every token has an adapter with expert LoRA here
    inter = rows * R * 2
    act = {"w13": m * H * 2 + inter + rows * 2 * I * 2, "w2": rows * I * 2 + inter + rows * H * 2}
    res["bytes_with_activations"] = {k: by[k] + act[k] for k in act}

    # ---- timings ----
    metas = [v13(l) for l in range(n)]
    for l in range(n):
        v2(l, metas[l])
        ops[l].add_w13(y13, x, lay.a13[l], lay.b13[l])
        ops[l].add_w2(y2, h, lay.a2[l], lay.b2[l], tw[l])
    torch.cuda.synchronize()
    t = {}
    t["vllm_w13"] = graph_us(lambda: [v13(l) for l in range(n)], n)
    t["vllm_w2"] = graph_us(lambda: [v2(l, metas[l]) for l in range(n)], n)
    t["ours_w13"] = graph_us(lambda: [ops[l].add_w13(y13, x, lay.a13[l], lay.b13[l])
                                      for l in range(n)], n)
    t["ours_w2"] = graph_us(lambda: [ops[l].add_w2(y2, h, lay.a2[l], lay.b2[l], tw[l])
                                     for l in range(n)], n)
    # per op, on preallocated partials
    from kernels.moe_lora.align import align_moe_lora

    bm, naive = int(cfg["block_m"]), bool(cfg.get("naive"))
    parallel = bool(cfg.get("align_parallel"))  # the sort the config runs
    t["align"] = 0.0 if naive else graph_us(
        lambda: [align_moe_lora(ids[l], slot, enabled[:NL], E, bm, parallel=parallel)
                 for l in range(n)], n)
    p13 = [moe_lora_shrink(x, lay.a13[l], ops[l].blocks, TOPK, cfg["shrink13"]) for l in range(n)]
    p2 = [moe_lora_shrink(h, lay.a2[l], ops[l].blocks, 1, cfg["shrink2"]) for l in range(n)]
    t["s13"] = graph_us(lambda: [moe_lora_shrink(x, lay.a13[l], ops[l].blocks, TOPK,
                                                 cfg["shrink13"], out=p13[l]) for l in range(n)], n)
    t["e13"] = graph_us(lambda: [moe_lora_expand(y13, p13[l], lay.b13[l], ops[l].blocks,
                                                 cfg["expand13"]) for l in range(n)], n)
    t["s2"] = graph_us(lambda: [moe_lora_shrink(h, lay.a2[l], ops[l].blocks, 1, cfg["shrink2"],
                                                out=p2[l]) for l in range(n)], n)
    t["e2"] = graph_us(lambda: [moe_lora_expand(y2, p2[l], lay.b2[l], ops[l].blocks,
                                                cfg["expand2"], topk_weights=tw[l])
                                for l in range(n)], n)
    res["us"] = t
    res["vllm_total"] = t["vllm_w13"] + t["vllm_w2"]
    res["ours_total"] = t["ours_w13"] + t["ours_w2"]
    res["speedup"] = res["vllm_total"] / res["ours_total"]
    bw = copy_tbs * 1e12
    res["pct_copy"] = {k: 100 * by[k] / (t[k] * 1e-6) / bw for k in ("s13", "e13", "s2", "e2")}
    res["pct_copy"]["ours_w13"] = 100 * by["w13"] / (t["ours_w13"] * 1e-6) / bw
    res["pct_copy"]["ours_w2"] = 100 * by["w2"] / (t["ours_w2"] * 1e-6) / bw
    res["pct_copy"]["vllm_w13"] = 100 * by["w13"] / (t["vllm_w13"] * 1e-6) / bw
    res["pct_copy"]["vllm_w2"] = 100 * by["w2"] / (t["vllm_w2"] * 1e-6) / bw
    with_act = res["bytes_with_activations"]
    res["pct_copy_with_activations"] = {
        f"{who}_{k}": 100 * with_act[k] / (t[f"{who}_{k}"] * 1e-6) / bw
        for who in ("ours", "vllm") for k in ("w13", "w2")}
    res["fold"] = fold_columns(m, lay, ids, slot, enabled, x, y13, y2, tw)
    return res


def fold_columns(m: int, lay: Layers, ids, slot, enabled, x, y13, y2, tw) -> dict:
    """GPT-OSS's path with the activation folded into the gate_up expand, per layer (CUDA-graph
    µs over the layers): gate_up writing ``act`` then down as a shrink + expand pair
    (``act``), against the down shrink folded into that expand (``act_fold``); and the largest
    difference of the folded down output from the pair's (same inputs). Decode sizes only
    (the fold's, ``FOLD_MAX_ROWS``; ``{}`` otherwise)."""
    from kernels.moe_lora.ops import FOLD_MAX_ROWS, MoELoRAOps

    n, dev = lay.n, x.device
    cfg = MoELoRAOps.config_for(m, hidden=H, intermediate=I, num_experts=E, top_k=TOPK, rank=R,
                                num_slots=NL, device=dev)
    if cfg.get("fused") or m * TOPK > FOLD_MAX_ROWS:
        return {}
    act = torch.empty(m * TOPK, I, dtype=torch.bfloat16, device=dev)
    out = {}
    for name, fold in (("act", False), ("act_fold", True)):
        ops = [MoELoRAOps(ids[l], slot, enabled[:NL], E, H, I, R, NL,
                          config=dict(cfg, fold_down=fold)) for l in range(n)]

        def step(l, ops=ops):
            ops[l].add_w13(y13, x, lay.a13[l], lay.b13[l], act=act, down_a=lay.a2[l])
            ops[l].add_w2(y2, act, lay.a2[l], lay.b2[l], tw[l])

        y2_in = y2.clone()
        step(0)
        out[f"y2_{name}"] = y2.float().clone()
        y2.copy_(y2_in)
        out[name] = graph_us(lambda: [step(l) for l in range(n)], n)
        y2.copy_(y2_in)
    diff = (out.pop("y2_act_fold") - out.pop("y2_act")).abs().max().item()
    return {**out, "fold_max_abs_diff": diff}


def print_table(rows: list[dict], copy_tbs: float) -> None:
    log(f"\ncopy ceiling {copy_tbs:.2f} TB/s (read+write); CUDA-graph µs per layer, median; "
        "%cp = LoRA weight bytes of the distinct pairs / time / copy ceiling; %cpA = the same "
        "with the activations each op must read (inputs, intermediate, the rows its add reads)")
    log(f"{'M':>5}{'pairs':>7} | {'vLLM13':>7}{'vLLM2':>7}{'vLLM':>7} | {'ours13':>7}{'ours2':>7}"
        f"{'ours':>7}{'x':>6} | {'align':>6}{'s13':>6}{'e13':>6}{'s2':>6}{'e2':>6} | "
        f"{'%cp13':>6}{'%cp2':>6}{'%s13':>5}{'%e13':>5}{'%s2':>5}{'%e2':>5}{'%v13':>5}{'%v2':>5}"
        f"{'%cpA13':>7}{'%cpA2':>6}{'%vA13':>6}{'%vA2':>5} | {'err13':>8}{'err2':>8}{'vErr13':>8}")
    for r in rows:
        if "us" not in r:
            log(f"{r['M']:>5}  failed: {r.get('error', '?')[-200:]}")
            continue
        t, p, pa = r["us"], r["pct_copy"], r["pct_copy_with_activations"]
        log(f"{r['M']:>5}{r['pairs']:>7.1f} | {t['vllm_w13']:>7.1f}{t['vllm_w2']:>7.1f}"
            f"{r['vllm_total']:>7.1f} | {t['ours_w13']:>7.1f}{t['ours_w2']:>7.1f}"
            f"{r['ours_total']:>7.1f}{r['speedup']:>6.2f} | {t['align']:>6.1f}{t['s13']:>6.1f}"
            f"{t['e13']:>6.1f}{t['s2']:>6.1f}{t['e2']:>6.1f} | {p['ours_w13']:>6.1f}"
            f"{p['ours_w2']:>6.1f}{p['s13']:>5.0f}{p['e13']:>5.0f}{p['s2']:>5.0f}{p['e2']:>5.0f}"
            f"{p['vllm_w13']:>5.1f}{p['vllm_w2']:>5.1f}{pa['ours_w13']:>7.1f}{pa['ours_w2']:>6.1f}"
            f"{pa['vllm_w13']:>6.1f}{pa['vllm_w2']:>5.1f} | {r['err13_ours']:>8.1e}"
            f"{r['err2_ours']:>8.1e}{r['err13_vllm']:>8.1e}")
    folded = [r for r in rows if r.get("fold")]
    if folded:
        log("\nGPT-OSS's activation path, gate_up (act) + down, µs per layer: the down shrink "
            "as its own launch vs folded into the gate_up expand (decode sizes)")
        log("| M | act, down pair | act, down folded | × | max abs diff of down's output |")
        log("|---|---|---|---|---|")
        for r in folded:
            f = r["fold"]
            log(f"| {r['M']} | {f['act']:.1f} | {f['act_fold']:.1f} | "
                f"{f['act'] / f['act_fold']:.2f}× | {f['fold_max_abs_diff']:.1e} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,64,256,1024")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import triton
    import vllm
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
            "torch": torch.__version__, "triton": triton.__version__, "layers": args.layers,
            "shape": dict(H=H, I=I, E=E, top_k=TOPK, slots=NL, rank=R)}
    log(json.dumps(info))
    copy_tbs = copy_bandwidth_tbs()
    info["copy_tbs"] = copy_tbs
    gen = torch.Generator(device="cuda").manual_seed(1234)
    lay = Layers(args.layers, gen)
    pw = PunicaWrapperGPU(8192, 256, torch.device("cuda"),
                          lora_config=SimpleNamespace(max_loras=NL, specialize_active_lora=False))
    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        try:
            r = run_m(m, lay, gen, pw, copy_tbs)
        except Exception as exc:  # keep the other sizes going; the error is reported
            import traceback

            traceback.print_exc()
            r = {"M": m, "error": repr(exc)}
        rows.append(r)
        log(json.dumps(r, default=str))
        torch.cuda.empty_cache()
    info["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1, default=str)
    print_table(rows, copy_tbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
