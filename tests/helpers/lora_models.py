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
