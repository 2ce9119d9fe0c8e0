"""The embedded base model: a tiny Qwen3-MoE with seeded random weights, saved as a HF folder.

The config is the one verified on vLLM-CPU (head_dim 32: CPU attention has no head size 16).
Weights are re-drawn from N(0, 0.2) (norms stay 1) so greedy decoding yields distinct tokens.
Deterministic: the same seed writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from app.embedded.tokenizer import build_tokenizer

WEIGHT_STD = 0.2


def tiny_qwen3_moe_config(vocab_size: int = 512, eos_token_id: int = 2, pad_token_id: int = 0):
    """The fixed ``Qwen3MoeConfig`` of the embedded model (2 layers, 8 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
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
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(dest: Path, seed: int = 0) -> Path:
    """Writes the tokenizer and the model (float32 safetensors) into ``dest``; returns ``dest``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3MoeForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    build_tokenizer(dest, seed)
    tok = AutoTokenizer.from_pretrained(str(dest))
    config = tiny_qwen3_moe_config(len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(str(dest), safe_serialization=True)
    return dest
