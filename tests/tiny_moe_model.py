"""Test helper: a tiny Qwen3-MoE checkpoint built locally (seeded random weights, local tokenizer).

No download: the config is fixed, weights are re-drawn with std 0.2 so greedy decoding produces
distinct tokens, and a byte-level BPE tokenizer (vocab 512, ChatML special tokens) is trained on a
small built-in text.
"""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. mixture of experts models route every token "
    "to a few experts. low rank adapters add a small product of two thin matrices to a weight. "
    "hello world, how are you today? numbers 0123456789 and punctuation !?.,;:-()[]{}"
)


def build_tokenizer(out_dir: Path):
    """Trains and saves a byte-level BPE tokenizer of vocab 512 into ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0, std: float = 0.2) -> Path:
    """Writes a Hugging Face folder (config, fp32 safetensors, tokenizer) and returns its path."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = Qwen3MoeConfig(
        **TINY_CONFIG,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out, safe_serialization=True)
    return out
