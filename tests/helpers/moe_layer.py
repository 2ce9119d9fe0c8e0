"""A whole MoE layer with multi-LoRA: PyTorch base GEMMs + the Triton LoRA ops.

The same data flow as vLLM's ``TritonExperts.apply`` (per-row caches ``[M*K, 2I]`` and
``[M*K, H]``, LoRA added into them, routing weights applied to the down rows, then a sum over
the K rows of each token), so it checks the Triton ops against ``kernels.reference`` end to end.
"""

from __future__ import annotations

import torch

from kernels.moe_lora.ops import MoELoRAOps
from kernels.moe_math import MoELoRAWeights, apply_activation


def moe_lora_layer(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_lora: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: MoELoRAWeights | None,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    config: dict | None = None,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T, H]`` for the arguments of ``kernels.reference.moe_lora_reference``;
    ``slot_ranks [L]``: each slot's adapter rank, for the ops to read the stacks up to
    (``MoELoRABlocks.slot_ranks``)."""
    t, k = topk_ids.shape
    flat_e = topk_ids.reshape(-1).long()
    rows_x = x.repeat_interleave(k, dim=0)  # [T*K, H]
    y13 = torch.bmm(rows_x.unsqueeze(1), w13[flat_e].transpose(1, 2)).squeeze(1)  # [T*K, 2I]
    if w13_bias is not None:
        y13 = y13 + w13_bias[flat_e]
    ops = None
    if lora is not None:
        enabled = lora.has_experts.to(torch.int32)
        if slot_ranks is not None:
            enabled = enabled * slot_ranks.to(device=enabled.device, dtype=torch.int32)
        ops = MoELoRAOps(topk_ids.to(torch.int32), token_lora.to(torch.int32),
                         enabled, num_experts=w13.shape[0],
                         hidden=x.shape[1], intermediate=w2.shape[2], rank=lora.rank,
                         num_slots=lora.num_slots, config=config,
                         slot_ranks=slot_ranks is not None)
        ops.add_w13(y13, x, lora.w13_a, lora.w13_b, scaling=lora.scaling)
    h = apply_activation(y13, activation).contiguous()  # [T*K, I]
    y2 = torch.bmm(h.unsqueeze(1), w2[flat_e].transpose(1, 2)).squeeze(1)  # [T*K, H]
    if w2_bias is not None:
        y2 = y2 + w2_bias[flat_e]
    y2 = (y2.float() * topk_weights.reshape(-1, 1).float()).to(x.dtype)
    if ops is not None:
        ops.add_w2(y2, h, lora.w2_a, lora.w2_b, topk_weights, scaling=lora.scaling)
    return y2.view(t, k, -1).float().sum(1).to(x.dtype)
