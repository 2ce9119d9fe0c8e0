"""End to end on a GPU: vLLM 0.24 with loraplex's MoE-LoRA kernels gives stock vLLM's outputs.

One vLLM engine in this process (eager, so the kernels can be switched between passes without
re-capturing graphs), GPT-OSS-20B shape with balanced random weights
(``benchmarks.engine.gpt_oss_dummy``; bf16 experts, or MXFP4 experts with ``--mxfp4``), adapters on
attention + the fused 3-D experts. The same requests run in passes:

1. ``stock``: vLLM's own LoRA path (``kernels.vllm.cuda.uninstall()``: vLLM's methods back, and
   loraplex's punica wrapper, which the engine was built with, behaving as vLLM's);
2. ``loraplex``: ``kernels.vllm.cuda.install()`` (the plugin's CUDA path);
3. ``stock again``: ``uninstall()`` again, the run-to-run noise floor of stock vLLM;
4. ``base``: the same prompts without an adapter (how much the adapters change outputs).

Each pass: ``--prompts`` prompts of ``--prompt-len`` random tokens spread over the adapters,
teacher-forced (``prompt_logprobs``: the log-probability of every prompt token, the prefill
path with thousands of tokens per step), then ``--new-tokens`` greedy tokens (the decode path,
one token per request per step). Compared: per-token |Δ log-prob| of the prompt tokens, greedy
token agreement (first divergence), and |Δ log-prob| of the greedy tokens before it.

Run on the GPU machine (vLLM 0.24 importable, repository root on ``PYTHONPATH``):
``python -m benchmarks.engine.equality [--mxfp4] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.engine.gpt_oss_dummy import (
    adapter_requests,
    add_run_args,
    in_process_engine_env,
    lora_engine,
    random_prompts,
    use_balanced_dummy_weights,
    write_adapters,
    write_model_dir,
)
from kernels.vllm.plugin import SWITCH_ENV


def _prompt_logprobs(out) -> list[float]:
    ids = out.prompt_token_ids
    return [d[ids[i]].logprob for i, d in enumerate(out.prompt_logprobs) if d is not None]


def _greedy(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]


def _ours_active() -> bool:
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    from kernels.vllm.cuda import moe

    return LoRAExpertsMixin.apply_w13_lora is moe._apply_w13_lora


def run_pass(llm, prompts, loras, new_tokens: int) -> dict:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    forced = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                          lora_request=loras, use_tqdm=False)
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens,
                                         ignore_eos=True, temperature=0.0, logprobs=0),
                          lora_request=loras, use_tqdm=False)
    return {"forced": [_prompt_logprobs(o) for o in forced],
            "greedy": [_greedy(o) for o in greedy], "seconds": time.perf_counter() - t0}


def compare(a: dict, b: dict) -> dict:
    """|Δ log-prob| over all teacher-forced tokens; greedy agreement of ``b`` with ``a``."""
    forced = [abs(x - y) for pa, pb in zip(a["forced"], b["forced"]) for x, y in zip(pa, pb)]
    same, first_div, greedy_d = 0, [], []
    for (ta, la), (tb, lb) in zip(a["greedy"], b["greedy"]):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        same += n == len(ta)
        first_div.append(n)
        greedy_d += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return {
        "forced_tokens": len(forced),
        "forced_mean_abs": statistics.fmean(forced), "forced_max_abs": max(forced),
        "forced_p99_abs": sorted(forced)[int(0.99 * (len(forced) - 1))],
        "greedy_identical": f"{same}/{len(first_div)}",
        "greedy_first_divergence_min": min(first_div),
        "greedy_mean_abs_before_divergence": statistics.fmean(greedy_d) if greedy_d else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, adapters=4, prompt_len=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapter-scale", type=float, default=0.01,
                    help="std of the random LoRA weights (0.01: an adapter moves log-probs by "
                         "about as much as the base layers do)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="the engine's slot rank (default: --rank); above it, the kernels read "
                         "each slot only up to its adapter's rank")
    args = ap.parse_args()

    in_process_engine_env()
    from kernels.vllm import cuda

    use_balanced_dummy_weights()
    model = write_model_dir(args.workdir, args.mxfp4)
    t = time.perf_counter()
    paths = write_adapters(f"{args.workdir}/adapters", args.adapters, args.rank, args.adapter_scale)
    print(f"adapters ready in {time.perf_counter() - t:.1f}s", flush=True)
    # The engine is built with loraplex's path on (its punica wrapper, the kernels' warm-up and,
    # for MXFP4, the unfused Triton experts: both sides on the same base GEMMs); the passes
    # switch it off and on (the stock passes run vLLM's own apply and LoRA ops).
    os.environ[SWITCH_ENV] = "1"
    llm = lora_engine(model, args.adapters, args.rank, eager=True, max_model_len=2048,
                      max_lora_rank=args.max_lora_rank)
    prompts = random_prompts(args.prompts, args.prompt_len)
    loras = adapter_requests(paths, args.prompts)
    passes = {}
    for name, ours, lora in (("stock", False, loras), ("loraplex", True, loras),
                             ("stock again", False, loras), ("base", False, None)):
        cuda.install() if ours else cuda.uninstall()
        assert _ours_active() == ours
        # every pass loads its adapters afresh: switching forgets the slots loraplex tracked
        # (each slot's adapter rank, which its kernels read up to), and activation records them
        for lora_id in sorted(llm.llm_engine.list_loras()):
            llm.llm_engine.remove_lora(lora_id)
        passes[name] = run_pass(llm, prompts, lora, args.new_tokens)
        print(f"pass {name}: {passes[name]['seconds']:.1f}s", flush=True)

    rows = {"loraplex vs stock": compare(passes["stock"], passes["loraplex"]),
            "stock again vs stock": compare(passes["stock"], passes["stock again"]),
            "base (no adapter) vs stock": compare(passes["stock"], passes["base"])}
    print(f"\nGPT-OSS-20B shape, {'MXFP4' if args.mxfp4 else 'bf16'} experts, {args.adapters} "
          f"adapters r{args.rank} (attention + experts; slots r{args.max_lora_rank or args.rank}), "
          f"{args.prompts} prompts x "
          f"{args.prompt_len} tokens + {args.new_tokens} greedy")
    keys = list(next(iter(rows.values())))
    print("| comparison | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                          for v in r.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "comparisons": rows,
                       "pass_seconds": {k: v["seconds"] for k, v in passes.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
