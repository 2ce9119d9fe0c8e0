"""vLLM's restack of a 3-D MoE adapter's expert tensors, written straight into a pinned block.

For a model whose experts take 3-D LoRA weights (``FusedMoE3DWithLoRA`` modules, the manager's
``_is_3d_moe_model``), vLLM's merge pass (``_create_merged_loras_inplace``) folds the scaling into
each expert B in place (``optimize``), then copies B into slot order (``_stack_moe_lora_weights``);
a pooled load (``kernels.vllm.lora_loads``) then copied everything once more into the pinned
region. Here each expert tensor is written once, scaled and in vLLM's order, into views of a
``pinned_region.Block``; vLLM's pass, run afterwards, finds the experts stacked (lists) with
scaling 1 and leaves them. Layouts (E experts; this EP rank's L of them from ``start``; rank r):

- A ``[E*r, in]`` -> ``[L, r, in]`` (rows of expert e are ``e*r … e*r+r-1``)
- B ``[out, r*E]`` -> ``[L, out, r]`` (column ``j*E + e`` is rank row j of expert e), times scaling

``<experts>.base_layer`` holds gate_up, ``<experts>`` down; afterwards ``<experts>`` holds the
lists ``[gate_up, down]`` and ``.base_layer`` keeps gate_up's tensors too, as vLLM leaves them.
Invariant: the result equals vLLM's pass tensor for tensor (``tests/kernels/vllm``).
"""

from __future__ import annotations

from typing import Any

from kernels.vllm.pinned_region import Block


def restacked_modules(adapter_manager: Any) -> list[tuple[str, Any]]:
    """``(name, FusedMoE3DWithLoRA)`` of ``adapter_manager`` (vLLM's ``LoRAModelManager``) whose
    adapters vLLM restacks; empty where it restacks none (2-D experts, mixed formats, no MoE)."""
    from vllm.lora.layers import FusedMoE3DWithLoRA

    if not getattr(adapter_manager, "_is_3d_moe_model", False):
        return []
    return [(n, m) for n, m in adapter_manager.modules.items() if isinstance(m, FusedMoE3DWithLoRA)]


def restack_into(adapter_manager: Any, lora_model: Any, block: Block) -> int:
    """Restacks ``lora_model``'s expert pairs into views of ``block`` as vLLM's merge pass would;
    the bytes written. A pair vLLM would refuse (one side missing) is left for vLLM's pass to
    refuse; raises ``ValueError`` (nothing replaced for that module) when the block is too small."""
    import torch

    written = 0
    for name, module in restacked_modules(adapter_manager):
        down = adapter_manager._get_lora_layer_weights(lora_model, name)
        gate_up = adapter_manager._get_lora_layer_weights(lora_model, name + ".base_layer")
        if down is None or gate_up is None or not torch.is_tensor(down.lora_a):
            continue
        local = module.w13_lora_a_stacked[0].shape[1]
        written += restack_pair(gate_up, down, module.global_num_experts, module.ep_rank * local, local, block)
    return written


def restack_pair(gate_up: Any, down: Any, experts: int, start: int, local: int, block: Block) -> int:
    """One module's pair (``LoRALayerWeights`` of gate_up and down, 2-D tensors as read) restacked
    into ``block`` for experts ``start … start+local-1`` of ``experts``: each side's tensors
    replaced by views, scaling 1, ``down`` holding the lists ``[gate_up, down]``; the bytes
    written. Raises ``ValueError`` (nothing replaced) when the block is too small."""
    pairs = [(_a(w.lora_a, experts, start, local, block), _b(w.lora_b, experts, start, local, w.scaling, block))
             for w in (gate_up, down)]
    written = 0
    for w, (a, b) in zip((gate_up, down), pairs):
        w.lora_a, w.lora_b, w.scaling = a, b, 1
        written += a.numel() * a.element_size() + b.numel() * b.element_size()
    down.lora_a, down.lora_b = [p[0] for p in pairs], [p[1] for p in pairs]
    return written


def _a(a: Any, experts: int, start: int, local: int, block: Block) -> Any:
    """``[E*r, in]`` -> this rank's ``[L, r, in]``, in ``block``."""
    return block.put(a.reshape(experts, -1, a.shape[-1])[start:start + local])


def _b(b: Any, experts: int, start: int, local: int, scaling: float, block: Block) -> Any:
    """``[out, r*E]`` -> this rank's ``[L, out, r]`` times ``scaling``, in ``block``."""
    import torch

    source = b.reshape(b.shape[0], -1, experts)[..., start:start + local].permute(2, 0, 1)
    if scaling == 1:
        return block.put(source)
    view = block.take(source.shape, source.dtype)
    torch.mul(source, scaling, out=view)
    return view
