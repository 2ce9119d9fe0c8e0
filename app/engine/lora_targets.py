"""Which of the base model's modules the engine wraps with LoRA (vLLM's ``lora_target_modules``).

The adapter registry accepts LoRA on attention projections, dense MLP projections and MoE experts
(``adapters_registry.validation``: the router, embeddings and LM head are refused at publish
time). Left unrestricted, vLLM also wraps the router, the embeddings and the LM head, and their
LoRA ops then run in every step for weights no served adapter can carry (on GPT-OSS-20B: 24
router LoRA layers, two launches each per step). Names are vLLM module suffixes; vLLM's packed
mapping covers ``qkv_proj`` / ``gate_up_proj`` through their parts.
"""

from __future__ import annotations

from adapters_registry.validation import ATTN_LEAVES, MLP_LEAVES

NON_EXPERT_LORA_TARGETS: tuple[str, ...] = (*sorted(ATTN_LEAVES), "qkv_proj", *sorted(MLP_LEAVES))
SERVED_LORA_TARGETS: tuple[str, ...] = (*NON_EXPERT_LORA_TARGETS, "experts")


def default_lora_targets(moe_lora_plugin: bool, cpu: bool) -> list[str]:
    """The engine's targets when the config names none: what the registry serves, except on
    vLLM-CPU without loraplex's expert path, which has no expert LoRA (experts are then no
    target; adapters carrying expert LoRA are refused by the engine deployment instead)."""
    return list(NON_EXPERT_LORA_TARGETS if cpu and not moe_lora_plugin else SERVED_LORA_TARGETS)
