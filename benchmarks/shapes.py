"""The model shapes every benchmark, tuner and shape-parametrised test uses, defined once.

``GPT_OSS_20B_CONFIG`` is the public architecture's ``config.json`` (bf16 experts; the GPU runs
load it with random weights), ``QWEN3_30B_A3B_CONFIG`` the fields of Qwen3-30B-A3B's that decide
shapes. ``MoEShape`` is what the kernels see of a model, derived from such a config: the expert
GEMMs (hidden, expert intermediate, experts, top-k, how gate_up LoRA comes: one shared-A slice
in PEFT's fused 3-D layout as GPT-OSS's adapters, or gate and up slices per expert as Qwen3-MoE's),
the activation, and the dense LoRA targets (q/k/v merged, o, the router).
"""

from __future__ import annotations

from dataclasses import dataclass

GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "swiglu_limit": 7.0,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "initial_context_length": 4096, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 150000, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "initializer_range": 0.02, "router_aux_loss_coef": 0.9, "output_router_logits": False,
}

QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
}


@dataclass(frozen=True)
class MoEShape:
    """One model's shapes as the LoRA kernels see them."""

    name: str
    hidden: int
    intermediate: int  # per expert
    num_experts: int
    top_k: int
    gate_up_slices: int  # 1: shared-A 3-D layout (GPT-OSS); 2: gate and up per expert (Qwen3-MoE)
    activation: str  # "swigluoai" (gate/up interleaved) or "silu" (gate rows first)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def experts(self) -> tuple[int, int, int, int]:
        """``(hidden, intermediate, experts, top_k)``."""
        return self.hidden, self.intermediate, self.num_experts, self.top_k

    @property
    def qkv(self) -> tuple[int, tuple[int, int, int]]:
        """Merged q/k/v LoRA: ``(in features, (q, k, v) out features)``."""
        kv = self.num_kv_heads * self.head_dim
        return self.hidden, (self.num_heads * self.head_dim, kv, kv)

    @property
    def o(self) -> tuple[int, tuple[int]]:
        return self.num_heads * self.head_dim, (self.hidden,)

    @property
    def router(self) -> tuple[int, tuple[int]]:
        return self.hidden, (self.num_experts,)

    def dense_ops(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The dense LoRA ops of an attention + router layer, by name."""
        return {"qkv": self.qkv, "o": self.o, "router": self.router}


def shape_of(name: str, config: dict) -> MoEShape:
    """The ``MoEShape`` of a Hugging Face config of GPT-OSS or Qwen3-MoE."""
    gpt_oss = config["model_type"] == "gpt_oss"
    return MoEShape(
        name=name, hidden=config["hidden_size"],
        intermediate=config["intermediate_size" if gpt_oss else "moe_intermediate_size"],
        num_experts=config["num_local_experts" if gpt_oss else "num_experts"],
        top_k=config["num_experts_per_tok"], gate_up_slices=1 if gpt_oss else 2,
        activation="swigluoai" if gpt_oss else "silu", num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"])


GPT_OSS_20B = shape_of("gpt-oss-20b", GPT_OSS_20B_CONFIG)
QWEN3_30B_A3B = shape_of("qwen3-30b-a3b", QWEN3_30B_A3B_CONFIG)
MODELS = {s.name: s for s in (GPT_OSS_20B, QWEN3_30B_A3B)}
# the LoRA settings of every GPU benchmark: adapter slots (max_loras), rank
SLOTS, RANK = 8, 32
