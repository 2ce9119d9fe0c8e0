"""PEFT-named random LoRA tensors for any base model, straight from its shapes (no PEFT, no
weights of the base): the GPU benchmarks' GPT-OSS-20B-sized adapters, the registry benchmark's,
and the tests' hostile variants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from adapters_registry.manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def synthetic_adapter(
    path: str | Path,
    base: BaseModelInfo,
    r: int = 8,
    alpha: int = 16,
    attn: list[str] | None = None,
    experts: Literal["none", "2d", "3d"] = "none",
    dtype: str = "float32",
    seed: int = 0,
    scale: float = 0.01,
) -> Path:
    """PEFT-named random LoRA tensors for ``base`` (shapes from its config)."""
    import torch
    from safetensors.torch import save_file

    attn = ATTN if attn is None else attn
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    shapes = base.module_shapes()
    tensors: dict[str, torch.Tensor] = {}

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    for layer in range(base.num_layers):
        p = f"base_model.model.model.layers.{layer}"
        for m in attn:
            d_in, d_out = shapes[m]
            tensors[f"{p}.self_attn.{m}.lora_A.weight"] = rnd(r, d_in)
            tensors[f"{p}.self_attn.{m}.lora_B.weight"] = rnd(d_out, r)
        if experts == "3d" and base.is_moe_layer(layer):
            e_, ex = base.num_experts, base.expert_shapes()
            h, i2 = ex["gate_up_proj"]
            i, _ = ex["down_proj"]
            tensors[f"{p}.mlp.experts.base_layer.lora_A.weight"] = rnd(e_ * r, h)
            tensors[f"{p}.mlp.experts.base_layer.lora_B.weight"] = rnd(i2, r * e_)
            tensors[f"{p}.mlp.experts.lora_A.weight"] = rnd(e_ * r, i)
            tensors[f"{p}.mlp.experts.lora_B.weight"] = rnd(h, r * e_)
        elif experts == "2d" and base.is_moe_layer(layer):
            for e in range(base.num_experts):
                for leaf in ("gate_proj", "up_proj", "down_proj"):
                    d_in, d_out = base.expert_shapes()[leaf]
                    tensors[f"{p}.mlp.experts.{e}.{leaf}.lora_A.weight"] = rnd(r, d_in)
                    tensors[f"{p}.mlp.experts.{e}.{leaf}.lora_B.weight"] = rnd(d_out, r)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    targets = list(attn) + (["gate_proj", "up_proj", "down_proj"] if experts == "2d" else [])
    cfg = {
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts == "3d" else None,
        "lora_dropout": 0.0, "bias": "none", "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "base_model_name_or_path": base.name, "task_type": "CAUSAL_LM",
    }
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out
