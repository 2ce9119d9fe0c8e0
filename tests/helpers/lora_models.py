"""Small adapters as vLLM's own ``LoRAModel`` / ``LoRALayerWeights`` hold them, for the tests of
loraplex's host-copy handling (``kernels.vllm.lora_pinning``, ``kernels.vllm.pinned_region``)."""

from __future__ import annotations

import torch


def small_lora_model(seed: int = 0, modules: int = 3, lora_id: int = 7, b_rows: int = 32,
                     b_dtype: torch.dtype = torch.float32):
    """A rank-4 adapter of ``modules`` plain layers (B: ``b_rows`` x 4 in ``b_dtype``) and one
    packed (list) layer with a gap (None in the middle)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(seed)
    loras = {f"layers.{i}.proj": LoRALayerWeights(f"layers.{i}.proj", 4, 8, torch.randn(4, 16, generator=g),
                                                  torch.randn(b_rows, 4, generator=g).to(b_dtype))
             for i in range(modules)}
    loras["layers.qkv"] = PackedLoRALayerWeights(
        "layers.qkv", 4, [8, None, 8], [torch.randn(4, 16, generator=g), None, torch.randn(4, 16, generator=g)],
        [torch.randn(32, 4, generator=g), None, torch.randn(32, 4, generator=g)], scaling=[2.0, 1.0, 2.0])
    return LoRAModel(lora_id, 4, loras)


def lora_tensors(model) -> list[torch.Tensor]:
    """Every tensor of ``model``, A then B per module, gaps of packed modules left out."""
    out = []
    for lora in model.loras.values():
        for side in (lora.lora_a, lora.lora_b):
            out.extend(t for t in (side if isinstance(side, list) else [side]) if t is not None)
    return out


def moe_3d_lora_model(seed: int = 0, layers: int = 2, experts: int = 4, rank: int = 4, hidden: int = 24,
                      inter: int = 20, alpha: int = 8, lora_id: int = 9):
    """A bfloat16 adapter in the 3-D PEFT MoE layout vLLM reads for GPT-OSS-like models: per layer,
    gate_up at ``<experts>.base_layer`` (A ``[E*r, hidden]``, B ``[2*inter, r*E]``), down at
    ``<experts>`` (A ``[E*r, inter]``, B ``[hidden, r*E]``), and q/k/v/o attention layers (q, k,
    v packed by the manager's ``qkv_proj``); scaling ``alpha / rank``."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    g = torch.Generator().manual_seed(seed)

    def layer(name: str, rows_a: int, cols_a: int, rows_b: int, cols_b: int) -> LoRALayerWeights:
        return LoRALayerWeights(name, rank, alpha, torch.randn(rows_a, cols_a, generator=g).to(torch.bfloat16),
                                torch.randn(rows_b, cols_b, generator=g).to(torch.bfloat16),
                                scaling=alpha / rank)

    loras = {}
    for i in range(layers):
        experts_name = f"model.layers.{i}.mlp.experts"
        loras[experts_name + ".base_layer"] = layer(experts_name + ".base_layer", experts * rank, hidden,
                                                    2 * inter, rank * experts)
        loras[experts_name] = layer(experts_name, experts * rank, inter, hidden, rank * experts)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{i}.self_attn.{proj}"
            loras[name] = layer(name, rank, hidden, hidden, rank)
    return LoRAModel(lora_id, rank, loras)


def moe_3d_manager(layers: int = 2, experts: int = 4, rank: int = 4, hidden: int = 24, ep_size: int = 1,
                   ep_rank: int = 0):
    """vLLM's ``LoRAModelManager`` as it stands for a 3-D MoE model (``FusedMoE3DWithLoRA`` experts,
    ``qkv_proj`` packed), built without a model or a GPU: what its merge pass reads, nothing more.
    ``ep_size`` ranks own ``experts / ep_size`` experts each."""
    from types import SimpleNamespace

    from torch import nn
    from vllm.lora.layers import FusedMoE3DWithLoRA
    from vllm.lora.model_manager import LoRAModelManager

    manager = LoRAModelManager.__new__(LoRAModelManager)
    manager.packed_modules = {f"model.layers.{i}.self_attn.qkv_proj":
                              [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
                              for i in range(layers)}
    manager.modules = {}
    for i in range(layers):
        module = FusedMoE3DWithLoRA.__new__(FusedMoE3DWithLoRA)
        nn.Module.__init__(module)
        module.w13_lora_a_stacked = (torch.zeros(1, experts // ep_size, rank, hidden),)
        module.moe_config = SimpleNamespace(num_experts=experts, moe_parallel_config=SimpleNamespace(ep_rank=ep_rank))
        manager.modules[f"model.layers.{i}.mlp.experts"] = module
    for attribute, value in (("_is_3d_moe_model", True), ("_enable_mixed_moe_lora_format", False),
                             ("_enable_moe_shared_loras", False), ("is_pooling_model", False),
                             ("_is_non_gated_moe", False)):
        setattr(manager, attribute, value)
    return manager
