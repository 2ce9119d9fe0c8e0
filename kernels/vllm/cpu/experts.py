"""A LoRA-capable vLLM-CPU experts class (vLLM 0.32.x): expert LoRA through ``cpu_moe_lora``.

vLLM 0.32 applies MoE-expert LoRA inside the experts class: ``FusedMoEWithLoRA`` requires
``experts.supports_lora()`` and hands the experts a ``MoELoRAContext`` (stacked LoRA weights, the
per-slot ``adapter_enabled`` flags and the Punica wrapper holding the token → slot mapping) through
``set_lora_context``. vLLM-CPU's experts classes do neither, so ``lora_experts_class(cls)`` derives
a subclass of the selected CPU experts class that does:

- tokens whose adapter slot has expert LoRA in this layer go through
  ``kernels.cpu.moe_lora.moe_lora_cpu_sliced`` on an unpacked copy of the expert weights (the
  native kernel prepacks its weights into a layout only it can read);
- all other tokens go through the native CPU kernel unchanged, so requests without an adapter
  (or with an attention-only adapter) get exactly the output they get without LoRA.

Limitation: the unpacked copy doubles the host memory of the experts, and in-place weight
reloads after start-up (RL weight sync) do not refresh it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels.cpu.moe_lora import MoELoRASlices, moe_lora_cpu_sliced

# Under vLLM's logger so the messages show in the engine's log.
logger = logging.getLogger("vllm.loraplex.cpu_experts")

_ACTIVATION_NAMES = {"silu": "silu", "swigluoai": "swigluoai"}
_cache: dict[type, type] = {}


class ExpertLoRAUnsupportedError(NotImplementedError):
    """The layer configuration cannot apply expert LoRA on CPU (activation, expert parallelism)."""


def activation_name(activation: Any) -> str:
    """vLLM ``MoEActivation`` (or a string) → ``"silu"`` / ``"swigluoai"``; raises otherwise."""
    name = str(getattr(activation, "value", activation)).lower()
    if name not in _ACTIVATION_NAMES:
        raise ExpertLoRAUnsupportedError(
            f"loraplex CPU expert LoRA supports activations {sorted(_ACTIVATION_NAMES)}, got {name!r}"
        )
    return _ACTIVATION_NAMES[name]


def token_slots(lora_context: Any, num_tokens: int) -> torch.Tensor:
    """Adapter slot of each of the ``num_tokens`` MoE input rows (``-1``: none), int64 ``[T]``."""
    mapping = lora_context.local_token_lora_mapping
    if mapping is None:
        mapping = lora_context.punica_wrapper.token_lora_indices
    mapping = mapping.to(torch.long)
    if mapping.shape[0] >= num_tokens:
        return mapping[:num_tokens]
    # Rows past the mapping are padding rows of the batch: no adapter.
    pad = torch.full((num_tokens - mapping.shape[0],), -1, dtype=torch.long)
    return torch.cat([mapping, pad])


def lora_slices(lora_context: Any) -> MoELoRASlices:
    """The context's stacked weights as ``MoELoRASlices`` (scaling already folded into B)."""
    enabled = lora_context.adapter_enabled[: lora_context.max_loras].to(torch.bool)
    return MoELoRASlices(
        w13_a=tuple(lora_context.w13_lora_a_stacked),
        w13_b=tuple(lora_context.w13_lora_b_stacked),
        w2_a=lora_context.w2_lora_a_stacked[0],
        w2_b=lora_context.w2_lora_b_stacked[0],
        scaling=None,
        enabled=enabled,
    )


class CPUExpertLoRAMixin:
    """Mixed in before a vLLM-CPU experts class; see the module doc."""

    _plain_w13: torch.Tensor | None = None
    _plain_w2: torch.Tensor | None = None
    _plain_w13_bias: torch.Tensor | None = None
    _plain_w2_bias: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Keep [E, 2I, H] / [E, H, I] copies before the native kernel pads and prepacks them.
        self._plain_w13 = layer.w13_weight.detach().clone()
        self._plain_w2 = layer.w2_weight.detach().clone()
        b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        self._plain_w13_bias = b13.detach().clone() if b13 is not None else None
        self._plain_w2_bias = b2.detach().clone() if b2 is not None else None
        super().process_weights_after_loading(layer)

    def _expert_lora_rows(self, num_tokens: int) -> tuple[torch.Tensor, MoELoRASlices] | None:
        """Per-token slots and weights if some token's adapter has expert LoRA here, else None."""
        ctx = getattr(self, "_lora_context", None)
        if ctx is None or num_tokens == 0:
            return None
        slices = lora_slices(ctx)
        if not bool(slices.enabled.any()):
            return None
        slots = token_slots(ctx, num_tokens)
        has_lora = (slots >= 0) & slices.enabled[slots.clamp_min(0)]
        if not bool(has_lora.any()):
            return None
        return torch.where(has_lora, slots, torch.full_like(slots, -1)), slices

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Any,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Any,
        apply_router_weight_on_input: bool,
    ) -> None:
        rows = self._expert_lora_rows(hidden_states.shape[0])
        native_args = (
            w1, w2, activation, global_num_experts, expert_map, a1q_scale, a2_scale,
            workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
        )
        if rows is None:
            return self._native_apply(output, hidden_states, topk_weights, topk_ids, native_args)
        if expert_map is not None:
            raise ExpertLoRAUnsupportedError("loraplex CPU expert LoRA: expert parallelism")
        ctx = self._lora_context
        if ctx.fully_sharded and ctx.tp_size > 1:
            raise ExpertLoRAUnsupportedError("loraplex CPU expert LoRA: fully_sharded_loras with TP")
        slots, slices = rows
        lora_idx = torch.nonzero(slots >= 0).flatten()
        base_idx = torch.nonzero(slots < 0).flatten()
        if base_idx.numel() > 0:
            base_out = output.new_empty(base_idx.numel(), output.shape[1])
            self._native_apply(
                base_out, hidden_states[base_idx], topk_weights[base_idx], topk_ids[base_idx],
                native_args,
            )
            output[base_idx] = base_out
        output[lora_idx] = moe_lora_cpu_sliced(
            hidden_states[lora_idx],
            topk_ids[lora_idx],
            topk_weights[lora_idx],
            slots[lora_idx],
            self._plain_w13,
            self._plain_w2,
            slices,
            activation=activation_name(activation),
            w13_bias=self._plain_w13_bias,
            w2_bias=self._plain_w2_bias,
            apply_router_weight=not apply_router_weight_on_input,
        ).to(output.dtype)
        return None

    def _native_apply(self, output, hidden_states, topk_weights, topk_ids, native_args) -> None:
        (w1, w2, activation, global_num_experts, expert_map, a1q_scale, a2_scale,
         workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input) = native_args
        super().apply(
            output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
            global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
            expert_tokens_meta, apply_router_weight_on_input,
        )


def lora_experts_class(native_cls: type) -> type:
    """The LoRA-capable subclass of a vLLM-CPU experts class (cached, one per native class)."""
    if native_cls in _cache:
        return _cache[native_cls]
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    cls = type(
        f"LoraplexLoRA{native_cls.__name__}",
        (CPUExpertLoRAMixin, LoRAExpertsMixin, native_cls),
        {"__module__": __name__, "__doc__": f"{native_cls.__name__} with loraplex expert LoRA."},
    )
    _cache[native_cls] = cls
    return cls


def unsupported_reason(moe_config: Any) -> str | None:
    """Why expert LoRA cannot run on CPU for this MoE layer configuration, or None."""
    try:
        activation_name(moe_config.activation)
    except ExpertLoRAUnsupportedError as e:
        return str(e)
    parallel = moe_config.moe_parallel_config
    if getattr(parallel, "use_ep", False):
        return "loraplex CPU expert LoRA does not support expert parallelism"
    return None


def choose_lora_experts_cls(moe_config: Any, selected_cls: type | None) -> type | None:
    """Oracle hook: substitutes the LoRA-capable subclass for vLLM-CPU's unquantized experts.

    Configurations it cannot serve keep the native class, so vLLM refuses expert LoRA at engine
    start ("does not support LoRA") instead of failing on the first adapter request.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    if selected_cls is None or not issubclass(selected_cls, CPUUnquantizedExperts):
        return selected_cls
    reason = unsupported_reason(moe_config)
    if reason is not None:
        logger.warning("%s; keeping %s without expert LoRA", reason, selected_cls.__name__)
        return selected_cls
    return lora_experts_class(selected_cls)
