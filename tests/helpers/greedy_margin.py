"""Greedy references and how decisively each of their tokens won.

Over hundreds of tokens two runs agree token for token only where no step is a near tie: a logit
gap of ~1e-5 can flip with the order of a sum (batch shapes differ between runs). A long
reference therefore carries its smallest top-1/top-2 gap (``min_gap`` of vLLM's top-2 logprobs:
log-softmax keeps logit differences), and a test asserts it is wide, so that a mismatch it finds
is a real one (another adapter's weights, stale KV blocks), not rounding. transformers + PEFT
anchor the start of each reference (``hf_greedy``: cheap for a few tokens, slow for hundreds).
"""

from __future__ import annotations

from pathlib import Path

import torch

GAP = 1e-4  # far above fp32 reordering noise on this model's logits (~1e-6)


def min_gap(top_logprobs: list[dict[str, float]]) -> float:
    """Smallest gap between the best and second-best logprob over a completion's steps."""
    return min(sorted(step.values(), reverse=True)[0] - sorted(step.values(), reverse=True)[1]
               for step in top_logprobs)


def hf_greedy(model_dir: Path, adapter_dir: Path | None, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy fp32 continuation that ignores EOS (as ``ignore_eos`` requests do)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()
