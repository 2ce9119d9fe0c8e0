"""Where a step's time goes with adapters: CUDA kernel time per family and per kernel, on a GPU.

One vLLM 0.24 engine in this process, as served (torch.compile, CUDA graphs, loraplex's plugin
as the environment switches it), GPT-OSS-20B shape with balanced random weights
(``benchmarks.engine.gpt_oss_dummy``; ``--mxfp4`` for MXFP4 experts), LoRA enabled with ``--adapters``
rank-32 adapters on attention + experts. Two workloads, each run under ``torch.profiler`` with
every request on an adapter, then on none:

- *prefill*: ``--prompts`` prompts of ``--prompt-len`` tokens, ``--prompts-per-step`` per step
  (1: the step a new request brings while serving; 5 x 1600: the 8192-token steps of a burst of
  new requests; beyond the CUDA-graph sizes, so torch.compile's graphs run eagerly);
- *decode*: ``--prompts`` requests of 32 tokens decoding ``--decode-steps`` tokens together
  (CUDA graphs; the profiler sees the kernels inside them); ``--decode-trace DIR`` adds a
  Chrome trace of a few such steps per column (``benchmarks.profiling.decode_timeline``);
- *mixed* (``--mixed N``): N new prompts, one at a time, each joining ``--prompts - 1``
  running decodes, as in a server's steady state (``benchmarks.profiling.mixed_steps``): TTFT and each
  forward's host time and device span; ``--trace DIR`` adds a Chrome trace of two such steps.

Both passes run on the LoRA engine; ``--base-engine`` also runs them on an engine without LoRA
(in a child process: the base a served model without adapters runs, and what "added" is then
measured against). Tables: milliseconds of kernel time per step per family (``kernel_family``)
in each column and the difference, the wall time per step, and the kernels that add the most.

Run on the GPU machine (vLLM 0.24 importable, repository root on ``PYTHONPATH``):
``python -m benchmarks.profiling.step_profile [--mxfp4] [--prompts-per-step 5] [--base-engine]
[--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from benchmarks.engine.gpt_oss_dummy import (
    ENGINE_ARGS,
    adapter_requests,
    add_run_args,
    in_process_engine_env,
    lora_engine,
    random_prompts,
    use_balanced_dummy_weights,
    write_adapters,
    write_model_dir,
)
from benchmarks.profiling.chrome_trace import trace_path, write_trace_gz
from benchmarks.profiling.host_profile import host_profile
from benchmarks.profiling.mixed_steps import print_mixed_table, run_mixed, trace_file
from benchmarks.profiling.runtime_calls import print_runtime_table, runtime_calls

# (family, pattern on the kernel name), first match wins
FAMILIES = [
    ("MoE-LoRA (loraplex)", r"_moe_lora_(align|count|place|shrink|expand|fused)_kernel"),
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


def runtime_pass(llm, batches, max_tokens: int, loras: bool, paths) -> dict:
    """``run_batches`` under the profiler with CPU activity: ``runtime_calls`` of the pass."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run_batches(llm, batches, max_tokens, loras, paths)
    return runtime_calls(prof.events())


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


def traced_decode(llm, batches, steps: int, loras: bool, paths, path: str | None) -> None:
    """``steps`` decode steps of ``batches`` (after their prefill step) under the CUDA profiler,
    written as a Chrome trace to ``path`` (``benchmarks.profiling.decode_timeline`` reads it);
    nothing when ``path`` is None."""
    import torch

    if path is None:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_batches(llm, batches, steps + 1, loras, paths)
    write_trace_gz(prof, path)


def decode_trace_file(args, label: str) -> str | None:
    """Where ``--decode-trace DIR`` puts a column's decode trace (None without it)."""
    return trace_path(args.decode_trace, "decode", label)


def per_step_families(kernels: dict, steps: int) -> dict[str, float]:
    """ms per step per family (``kernel_family``) of per-kernel ``(ms, launches)`` totals."""
    out: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        out[kernel_family(name)] += ms / steps
    return dict(out)


def print_tables(title: str, steps: int, columns: dict[str, tuple[dict, float]], top: int) -> dict:
    """Family table and the ``top`` kernels by added time, in ms per step; returns the figures.

    ``columns``: label -> (per-kernel ``(ms, launches)`` totals, wall ms over the ``steps``),
    the first the run with adapters, the last the baseline "added" is measured against."""
    labels = list(columns)
    fams = {c: per_step_families(columns[c][0], steps) for c in labels}
    first = fams[labels[0]]
    print(f"\n{title}; ms per step ({steps} steps)")
    print("| family | " + " | ".join(labels) + " | added |")
    print("|---|" + "---|" * (len(labels) + 1))
    for f in sorted(set().union(*fams.values()), key=lambda f: -first.get(f, 0.0)):
        vals = [fams[c].get(f, 0.0) for c in labels]
        print(f"| {f} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {vals[0] - vals[-1]:+.3f} |")
    totals = [sum(fams[c].values()) for c in labels]
    walls = [columns[c][1] / steps for c in labels]
    for name, vals in (("all kernels", totals), ("wall time", walls)):
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {vals[0] - vals[-1]:+.3f} "
              f"({vals[0] / vals[-1]:.2f}×) |")
    with_k, base_k = columns[labels[0]][0], columns[labels[-1]][0]
    added = {n: with_k.get(n, (0.0, 0))[0] - base_k.get(n, (0.0, 0))[0]
             for n in set(with_k) | set(base_k)}
    print(f"\ntop {top} kernels by time added per step ({labels[0]} vs {labels[-1]}; launches "
          "per step in each)")
    print("| kernel | with | without | added | launches |")
    print("|---|---|---|---|---|")
    for n in sorted(added, key=lambda n: -abs(added[n]))[:top]:
        a, b = with_k.get(n, (0.0, 0)), base_k.get(n, (0.0, 0))
        print(f"| `{n[:90]}` | {a[0] / steps:.3f} | {b[0] / steps:.3f} | "
              f"{added[n] / steps:+.3f} | {a[1] / steps:.1f} / {b[1] / steps:.1f} |")
    return {"steps": steps, "columns": labels, "families": fams, "wall_ms_per_step": walls,
            "kernels": {c: columns[c][0] for c in labels}}


def phases(args) -> list[tuple[str, list, int, int]]:
    """``(name, batches, max_tokens, steps)`` of the two workloads: prefill batches of
    ``--prompts-per-step`` prompts (one step each), then the decode batch."""
    if args.mixed_only:
        return []
    per_step = args.prompts_per_step
    if per_step * args.prompt_len > ENGINE_ARGS["max_num_batched_tokens"]:
        raise SystemExit(f"--prompts-per-step {per_step} x --prompt-len {args.prompt_len} exceeds "
                         f"the engine's {ENGINE_ARGS['max_num_batched_tokens']} tokens per step")
    prompts = [p[: len(p) - i % (args.vary_len + 1)]  # --vary-len: a token count per step
               for i, p in enumerate(random_prompts(args.prompts, args.prompt_len))]
    prefill = [prompts[i:i + per_step] for i in range(0, len(prompts) - per_step + 1, per_step)]
    decode = [random_prompts(args.prompts, 32, seed=1)]
    return [("prefill", prefill, 1, len(prefill)),
            ("decode", decode, args.decode_steps + 1, args.decode_steps)]


def base_engine_passes() -> dict[str, tuple[dict, float]]:
    """The phases on an engine without LoRA, in a child process run with this process's
    arguments (the GPU holds one engine at a time): per phase, per-kernel ``(ms, launches)`` and
    wall ms."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "base.json")
        cmd = [sys.executable, "-m", "benchmarks.profiling.step_profile", *sys.argv[1:],
               "--child-base", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            raw = json.load(f)
    return {name: (val if name.endswith(" runtime") or name == "mixed" else tuple(val))
            for name, val in raw.items()}


def child_base(args, model, out: str) -> None:
    """``base_engine_passes``' child: the phases without adapters on a LoRA-less engine, written
    to ``out`` as JSON."""
    llm = lora_engine(model, args.adapters, 32, eager=False, max_model_len=4096, lora=False)
    result = {}
    for name, batches, max_tokens, _ in phases(args):
        profile_pass(llm, batches, max_tokens, False, [])  # warm
        result[name] = profile_pass(llm, batches, max_tokens, False, [])
        if args.runtime_calls:
            result[f"{name} runtime"] = runtime_pass(llm, batches, max_tokens, False, [])
        if name == "decode":
            traced_decode(llm, batches, args.decode_trace_steps, False, [],
                          decode_trace_file(args, "LoRA off"))
    if args.mixed:
        result["mixed"] = run_mixed(llm, args, None, trace=trace_file(args, "LoRA off"))
    with open(out, "w") as f:
        json.dump(result, f)
    if args.cprofile:  # the base engine's host time, printed here (same output stream)
        host_profile(host_passes(llm, args, [], (("LoRA off", False),)), args.cprofile,
                     args.cprofile_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, adapters=8, prompt_len=1600)
    ap.add_argument("--decode-steps", type=int, default=128,
                    help="decode phase: --prompts requests of 32 tokens, this many new tokens")
    ap.add_argument("--prompts-per-step", type=int, default=1,
                    help="prefill phase: prompts per step (5 x 1600 tokens: the 8192-token steps "
                         "of a burst of new requests)")
    ap.add_argument("--base-engine", action="store_true",
                    help="also profile an engine without LoRA (a served base model) and measure "
                         "what the adapters add against it")
    ap.add_argument("--vary-len", type=int, default=0, metavar="N",
                    help="prefill prompt i is i %% (N+1) tokens shorter: each step a token count "
                         "of its own, as a server's steps (which launches stay prepared shows)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also profile the prefill (and --mixed) passes' Python (host) time: "
                         "top N functions (with --base-engine also the LoRA-off engine's)")
    ap.add_argument("--cprofile-dir", default=None,
                    help="with --cprofile: also write the raw stats (pstats files) here")
    ap.add_argument("--runtime-calls", action="store_true",
                    help="also a pass per column with the profiler's CPU activity: the host's "
                         "CUDA API calls per step (launches, copies, waits for the GPU)")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="also N new prompts of --prompt-len tokens, one at a time, each joining "
                         "--prompts - 1 running decodes (the serving steady phase's slow step): "
                         "TTFT and the forwards' host time and device span "
                         "(benchmarks.profiling.mixed_steps)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="with --mixed: also a Chrome trace (host and kernels, .json.gz) of two "
                         "mixed steps per column, written here")
    ap.add_argument("--decode-trace", default=None, metavar="DIR",
                    help="also a Chrome trace (kernels only, .json.gz) of --decode-trace-steps "
                         "decode steps per column, written here "
                         "(benchmarks.profiling.decode_timeline reads them)")
    ap.add_argument("--decode-trace-steps", type=int, default=16)
    ap.add_argument("--mixed-only", action="store_true",
                    help="with --mixed: skip the prefill and decode profiles")
    ap.add_argument("--child-base", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    in_process_engine_env()
    use_balanced_dummy_weights()
    model = write_model_dir(args.workdir, args.mxfp4)
    if args.child_base:
        return child_base(args, model, args.child_base)
    base = base_engine_passes() if args.base_engine else {}
    paths = write_adapters(f"{args.workdir}/adapters", args.adapters, 32, 0.002)
    llm = lora_engine(model, args.adapters, 32, eager=False, max_model_len=4096)
    label = f"GPT-OSS-20B shape, {'MXFP4' if args.mxfp4 else 'bf16'} experts, {args.adapters} " \
            f"adapters r32"
    report = {"args": vars(args)}
    for name, batches, max_tokens, steps in phases(args):
        for lr in (True, False):  # warm: adapters resident, every kernel compiled
            profile_pass(llm, batches, max_tokens, lr, paths)
        columns = {"with adapters": profile_pass(llm, batches, max_tokens, True, paths),
                   "LoRA on, no adapter": profile_pass(llm, batches, max_tokens, False, paths)}
        if name in base:
            columns["LoRA off"] = base[name]
        title = (f"{label}: prefill, {args.prompts_per_step} x {args.prompt_len}-token prompt(s) "
                 "per step" if name == "prefill" else
                 f"{label}: decode, {args.prompts} requests (+ one small prefill step)")
        report[name] = print_tables(title, steps, columns, args.top)
        if args.runtime_calls:
            calls = {"with adapters": runtime_pass(llm, batches, max_tokens, True, paths),
                     "LoRA on, no adapter": runtime_pass(llm, batches, max_tokens, False, paths)}
            if f"{name} runtime" in base:
                calls["LoRA off"] = base[f"{name} runtime"]
            print_runtime_table(f"{label}: {name}", steps, calls)
            report[f"{name} runtime"] = calls
        if name == "decode":
            for column, lr in (("with adapters", True), ("LoRA on, no adapter", False)):
                traced_decode(llm, batches, args.decode_trace_steps, lr, paths,
                              decode_trace_file(args, column))
    if args.mixed:
        columns = {"with adapters": run_mixed(llm, args, adapter_requests(paths, args.adapters),
                                              trace=trace_file(args, "with adapters")),
                   "LoRA on, no adapter": run_mixed(llm, args, None,
                                                    trace=trace_file(args, "no adapter"))}
        if "mixed" in base:
            columns["LoRA off"] = base["mixed"]
        print_mixed_table(f"{label}: {args.prompts - 1} decodes + 1 x {args.prompt_len} tokens",
                          columns)
        report["mixed"] = columns
    if args.cprofile:
        report["host"] = host_profile(
            host_passes(llm, args, paths, (("with adapters", True), ("without", False))),
            args.cprofile, args.cprofile_dir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def host_passes(llm, args, paths, columns) -> list[tuple[str, object]]:
    """``(label, pass)`` for ``host_profile``: per column ``(label, with adapters)`` the prefill
    passes (steps run without CUDA graphs) and, with ``--mixed``, a mixed pass without decode
    steps between the prompts."""
    out = []
    prefill = phases(args)[0][1] if phases(args) else None
    for label, loras in columns:
        if prefill:
            out.append((f"prefill {label}", lambda loras=loras: run_batches(
                llm, prefill, 1, loras, paths)))
        if args.mixed:
            reqs = adapter_requests(paths, args.adapters) if loras else None
            out.append((f"mixed {label}", lambda reqs=reqs: run_mixed(llm, args, reqs, gap=0)))
    return out


if __name__ == "__main__":
    main()
