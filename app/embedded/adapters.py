"""Demo LoRA adapters for the embedded model, made with PEFT (safetensors, non-zero B).

``attention``: q/k/v/o projections. ``experts``: attention plus the MoE experts through PEFT's
fused-expert (3-D) ``target_parameters`` layout, as transformers 5 keeps experts fused.
Deterministic for a seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
B_STD = 0.08


class DemoAdapterSpec(BaseModel):
    """One demo adapter of the embedded default."""

    adapter_id: str = Field(description="Adapter id clients call it by.")
    tenant: str = Field(description="Owner tenant.")
    kind: Literal["attention", "experts"] = Field(description="Which weights it adapts.")
    rank: int = Field(8, ge=1, description="LoRA rank.")
    seed: int = Field(description="Seed of its random weights.")


def build_peft_adapter(base_dir: Path, dest: Path, kind: str, rank: int, seed: int) -> Path:
    """Writes a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into ``dest``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(ATTENTION_MODULES),
        target_parameters=list(EXPERT_PARAMETERS) if kind == "experts" else None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * B_STD)
    peft_model.save_pretrained(str(dest), safe_serialization=True)
    return dest
