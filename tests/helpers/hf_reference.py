"""transformers + PEFT greedy decoding: the reference every served output is compared with."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=1)
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: Path, content: str) -> list[int]:
    tok = tokenizer(str(model_dir))
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def prompt_ids(model_dir: Path, text: str) -> list[int]:
    return tokenizer(str(model_dir))(text, add_special_tokens=False).input_ids


def load_model(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """The base model in fp32 with the PEFT adapter of ``adapter_dir`` on it (None: none), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def teacher_forced_logits(model: torch.nn.Module, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: the model's next-token logits before each of ``tokens`` (a
    continuation of ``ids``), given the prompt and the tokens before it; one forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]


def greedy(model_dir: Path, adapter_dir: Path | None, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation token ids (fp32), stopping at EOS like vLLM does."""
    model = load_model(model_dir, adapter_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=tokenizer(str(model_dir)).eos_token_id, pad_token_id=0,
        )
    gen = out[0, len(ids):].tolist()
    eos = tokenizer(str(model_dir)).eos_token_id
    return gen[: gen.index(eos)] if eos in gen else gen


def decode(model_dir: Path, ids: list[int]) -> str:
    return tokenizer(str(model_dir)).decode(ids, skip_special_tokens=True)
