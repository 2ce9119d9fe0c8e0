"""Test helpers for MoE-expert LoRA: read PEFT adapters into the reference layout, write a
per-expert (2-D) adapter with independent gate/up LoRA, and merge a 2-D adapter into a
transformers model (the reference for adapters PEFT cannot load on transformers 5)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from adapters_registry.peft_layouts import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FUSED_PARAM_ORDER,
)
from kernels.moe_math import MoELoRAWeights

_PER_EXPERT = re.compile(
    r"layers\.(?P<l>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<m>gate_proj|up_proj|down_proj)\."
    r"(?P<ab>lora_A|lora_B)\.weight$"
)
_ATTENTION = re.compile(r"^base_model\.model\.(?P<mod>.*\.self_attn\.[qkvo]_proj)\.(?P<ab>lora_A|lora_B)\.weight$")


def read_adapter(adapter_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return (
        load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)),
        json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()),
    )


def scaling_of(config: dict) -> float:
    r = config["r"]
    return config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)


def fused_pairs(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"gate_up_proj": (lora_A, lora_B), "down_proj": ...}`` of a 3-D adapter's layer."""
    prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
    by_depth: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(re.escape(prefix) + r"((?:\.base_layer)*)\.(lora_A|lora_B)\.weight", key)
        if m:
            by_depth.setdefault(m.group(1).count(".base_layer"), {})[m.group(2)] = t
    names = FUSED_PARAM_ORDER[: len(by_depth)]
    return {n: (by_depth[d]["lora_A"], by_depth[d]["lora_B"]) for n, d in zip(names, sorted(by_depth, reverse=True))}


def reference_from_fused(tensors: dict[str, torch.Tensor], config: dict, layer: int) -> MoELoRAWeights:
    """One-slot ``MoELoRAWeights`` of a 3-D adapter's layer (shared A, ``[gate; up]`` B rows)."""
    pairs = fused_pairs(tensors, layer)
    r = config["r"]
    (a13, b13), (a2, b2) = pairs["gate_up_proj"], pairs["down_proj"]
    E = a13.shape[0] // r

    def a_of(a):
        return a.reshape(E, r, a.shape[1])[None]

    def b_of(b):
        return b.reshape(b.shape[0], r, E).permute(2, 0, 1)[None]

    return MoELoRAWeights(
        w13_a=a_of(a13), w13_b=b_of(b13), w2_a=a_of(a2), w2_b=b_of(b2),
        scaling=torch.tensor([scaling_of(config)]), has_experts=torch.tensor([True]),
    )


def per_expert_factors(tensors: dict[str, torch.Tensor], layer: int) -> dict[tuple[int, str], tuple]:
    """``{(expert, module): (A, B)}`` of a 2-D adapter's layer."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PER_EXPERT.search(key)
        if m and int(m.group("l")) == layer:
            out.setdefault((int(m.group("e")), m.group("m")), {})[m.group("ab")] = t
    return {k: (v["lora_A"], v["lora_B"]) for k, v in out.items()}


def expert_deltas_from_per_expert(
    tensors: dict[str, torch.Tensor], config: dict, layer: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged weight deltas ``[E, 2I, H]`` (gate rows first) and ``[E, H, I]`` of a 2-D adapter."""
    f = per_expert_factors(tensors, layer)
    s = scaling_of(config)
    d13 = torch.stack([
        torch.cat([f[(e, "gate_proj")][1] @ f[(e, "gate_proj")][0], f[(e, "up_proj")][1] @ f[(e, "up_proj")][0]])
        for e in range(num_experts)
    ]) * s
    d2 = torch.stack([f[(e, "down_proj")][1] @ f[(e, "down_proj")][0] for e in range(num_experts)]) * s
    return d13, d2


def write_per_expert_adapter(model_dir: Path, dest: Path, rank: int, seed: int, b_std: float = 0.08) -> Path:
    """A 2-D PEFT adapter (attention + per-expert gate/up/down, independent gate and up A) for the
    tiny Qwen3-MoE in ``model_dir``; random, deterministic for ``seed``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    q_out = cfg.num_attention_heads * cfg.head_dim
    kv_out = cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (H, q_out), "k_proj": (H, kv_out), "v_proj": (H, kv_out), "o_proj": (q_out, H)}
    g = torch.Generator().manual_seed(seed)

    def pair(key: str, n_in: int, n_out: int) -> dict[str, torch.Tensor]:
        return {
            f"{key}.lora_A.weight": torch.randn(rank, n_in, generator=g) * n_in**-0.5,
            f"{key}.lora_B.weight": torch.randn(n_out, rank, generator=g) * b_std,
        }

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_hidden_layers):
        base = f"base_model.model.model.layers.{layer}"
        for mod, (n_in, n_out) in shapes.items():
            tensors.update(pair(f"{base}.self_attn.{mod}", n_in, n_out))
        for e in range(E):
            tensors.update(pair(f"{base}.mlp.experts.{e}.gate_proj", H, I))
            tensors.update(pair(f"{base}.mlp.experts.{e}.up_proj", H, I))
            tensors.update(pair(f"{base}.mlp.experts.{e}.down_proj", I, H))
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "target_modules": sorted([*shapes, "gate_proj", "up_proj", "down_proj"]),
        "base_model_name_or_path": str(model_dir),
    }
    (dest / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return dest


def attention_only_copy(adapter_dir: Path, dest: Path) -> Path:
    """The adapter without its expert LoRA (attention tensors only, targets q/k/v/o): what an
    engine that dropped the expert part would serve."""
    from safetensors.torch import save_file

    tensors, config = read_adapter(adapter_dir)
    kept = {k: v for k, v in tensors.items() if _ATTENTION.match(k)}
    assert kept and len(kept) < len(tensors), "expected attention and expert tensors"
    dest.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = dict(config, target_modules=sorted({_ATTENTION.match(k)["mod"].rsplit(".", 1)[-1]
                                                 for k in kept}), target_parameters=None)
    (dest / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return dest


def merged_model(model_dir: Path, adapter_dir: Path):
    """transformers model (fp32) with a 2-D adapter (attention + per-expert) merged into its weights."""
    from transformers import AutoModelForCausalLM

    tensors, config = read_adapter(adapter_dir)
    s = scaling_of(config)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    attention: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _ATTENTION.match(key)
        if m:
            attention.setdefault(m.group("mod"), {})[m.group("ab")] = t
    with torch.no_grad():
        for mod, ab in attention.items():
            modules[mod].weight += s * ab["lora_B"] @ ab["lora_A"]
        for layer in range(model.config.num_hidden_layers):
            experts = modules[f"model.layers.{layer}.mlp.experts"]
            d13, d2 = expert_deltas_from_per_expert(tensors, config, layer, model.config.num_experts)
            experts.gate_up_proj += d13
            experts.down_proj += d2
    return model


def greedy_with(model, ids: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    """Greedy continuation of ``ids`` (stops at EOS like vLLM)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_token_id, pad_token_id=0,
        )
    gen = out[0, len(ids):].tolist()
    return gen[: gen.index(eos_token_id)] if eos_token_id in gen else gen
