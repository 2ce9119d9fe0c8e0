"""vLLM 0.24 on CUDA, MoE layers: loraplex's Triton MoE-LoRA ops replace vLLM's ``fused_moe_lora``.

vLLM 0.24 adds expert LoRA inside ``TritonExperts.apply`` through two methods of
``LoRAExpertsMixin``: ``apply_w13_lora`` (gate_up, after the base w13 GEMM, into
``intermediate_cache1 [M, K, N]``) returns a 4-tuple of routing metadata that ``apply_w2_lora``
(down, into ``intermediate_cache3 [M, K, H]``, routing weights applied) receives back. ``install``
replaces both methods: gate_up sorts the rows once (``kernels.moe_lora.layer.MoELoRALayer``,
kept per LoRA context in an ``ObjectMap``) and hands the step to down through the first slot of
that tuple, so the pair shares one block layout.

Mapping of vLLM's stacks (``MoELoRAContext``): ``w13_lora_a_stacked`` is one ``[L, E, r, H]``
tensor for the 3-D fused-expert layout (GPT-OSS; B ``[L, E, 2I, r]`` in the base's row order,
interleaved for GPT-OSS) or two (gate, up) for per-expert adapters (Qwen3-MoE; B ``[L, E, I, r]``
each, written to columns ``[0, I)`` and ``[I, 2I)``): our ops take 1 or 2 slices as they are, so
nothing is copied. vLLM folds the LoRA scaling into B, so no scale is applied here. Slot validity
and rank come from ``live.slot_ranks`` (0 for an adapter without expert LoRA: its rows are
skipped; otherwise A rows and B columns are read up to the adapter's rank, not the stack's), or
from vLLM's ``adapter_enabled`` flags where the slots are not tracked.

``install`` also warms the kernels up when vLLM sets up each MoE layer's LoRA
(``kernels.vllm.cuda.warmup``); the other integrations of the CUDA path are installed beside
it by ``kernels.vllm.cuda.install``.

Cases vLLM's own path keeps (the original methods are called): expert parallelism
(``expert_map`` or a per-rank token map), fully sharded LoRA, tensor parallelism > 1, and
dtypes other than bf16/fp16.
"""

from __future__ import annotations

import torch

from kernels.vllm.cuda import live
from kernels.vllm.cuda.oai import unfused_class
from kernels.vllm.cuda.warmup import warm_up_layer
from kernels.vllm.patching import ObjectMap, Patches

_SKIP = object()  # gate_up found no LoRA token: down skips too
_supported: ObjectMap[bool] = ObjectMap()  # per LoRA context: loraplex's ops take the layer
_layers: ObjectMap = ObjectMap()  # per LoRA context: its ``MoELoRALayer``
_vllm: dict[str, object] = {}  # vLLM's own methods, for the cases it keeps


def _ctx_supported(ctx) -> bool:
    a = ctx.w13_lora_a_stacked[0]
    return (ctx.local_token_lora_mapping is None and not ctx.fully_sharded and ctx.tp_size == 1
            and a.dtype in (torch.bfloat16, torch.float16) and a.is_cuda)


def _ours_applies(ctx, x: torch.Tensor, expert_map) -> bool:
    ok = _supported.get(ctx)  # a layer's context: fixed at model setup
    if ok is None:
        ok = _supported[ctx] = _ctx_supported(ctx)
    return expert_map is None and ok and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda


def warm_up_after(set_mapping):
    """``FusedMoEWithLoRA.set_mapping`` (model setup: before the profile run and graph capture)
    followed by the kernel warm-up, so no batch size compiles a kernel while serving."""

    def set_mapping_and_warm_up(self, punica_wrapper):
        set_mapping(self, punica_wrapper)
        experts = self._moe_kernel.fused_experts
        ctx = getattr(experts, "_lora_context", None)
        if ctx is not None and _ctx_supported(ctx):
            unfused_mxfp4 = unfused_class()  # sorted rows, folded activation
            warm_up_layer(ctx, ctx.top_k, mxfp4=unfused_mxfp4 is not None
                          and isinstance(experts, unfused_mxfp4))

    return set_mapping_and_warm_up


def _moe_layer(ctx):
    """The layer's ``MoELoRALayer`` (kept per context; rebuilt if its stacks moved)."""
    from kernels.moe_lora.layer import MoELoRALayer

    layer = _layers.get(ctx)
    if layer is None or layer.a13[0].data_ptr() != ctx.w13_lora_a_stacked[0].data_ptr():
        layer = _layers[ctx] = MoELoRALayer(
            ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked, ctx.w2_lora_a_stacked[0],
            ctx.w2_lora_b_stacked[0], num_experts=ctx.local_num_experts, num_slots=ctx.max_loras)
    return layer


def _gate_up(ctx, y2d: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
             add_inputs: bool = True, act: torch.Tensor | None = None,
             row_map: torch.Tensor | None = None):
    """loraplex's gate_up LoRA into ``y2d [M*K, N]`` (``x [M, H]``, ``topk_ids [M, K]``;
    ``act``, ``row_map``: see ``MoELoRALayer.gate_up``): the step for ``down``, or ``_SKIP``
    when no token of the step has expert LoRA."""
    warm_up_layer(ctx, topk_ids.shape[1])  # normally done at set_mapping; before the exits below
    if live.moe_step_idle(ctx):  # no expert LoRA in this step (vLLM's early exit)
        return _SKIP
    token_lora = ctx.punica_wrapper.token_mapping_meta.token_lora_mapping[: x.size(0)]
    x2d = x if x.stride(-1) == 1 else x.contiguous()
    ranks = live.slot_ranks(ctx.w13_lora_a_stacked[0])
    enabled = ranks if ranks is not None else ctx.adapter_enabled[: ctx.max_loras]
    return _moe_layer(ctx).gate_up(y2d, x2d, topk_ids, token_lora, enabled,
                                   add_inputs=add_inputs, act=act, row_map=row_map,
                                   slot_ranks=ranks is not None)


def takes_layer(ctx, x: torch.Tensor) -> bool:
    """Whether loraplex's ops run this MoE layer's LoRA for input ``x`` (no expert map)."""
    return _ours_applies(ctx, x, None)


def unfused_gate_up(ctx, y13: torch.Tensor, act: torch.Tensor, x: torch.Tensor,
                    topk_ids: torch.Tensor, row_map: torch.Tensor | None, swiglu: bool):
    """For the MXFP4 experts (``kernels.vllm.cuda.mxfp4``; ``takes_layer`` checked): gate_up
    LoRA into ``y13 [M*K, 2I]`` (the w13 GEMM's output, gate/up interleaved; ``x [M, H]``,
    ``topk_ids [M, K]``), pair ``t*K+k``'s row at ``row_map[t*K+k]`` (the GEMM's expert-sorted
    rows; None: ``t*K+k``). ``swiglu``: GPT-OSS's activation (``kernels.moe_math``'s alpha and
    limit) folded in, ``act [M*K, I]`` of every row written from the expand's sum or, for rows
    without expert LoRA, by the complement kernel. Returns ``(hook tuple for apply_w2_lora,
    act written)``; ``act written`` is False where the fold does not apply (not ``swiglu``, two
    gate/up slices, a padded N, the tiny-batch fused launch): then ``y13`` holds the sum and the
    caller runs the activation. The step keeps ``row_map`` for down's input rows. The kernel
    for rows without expert LoRA is skipped when every token of the step has it
    (``live.covers_all_tokens``)."""
    from kernels.moe_lora.activation import swiglu_rows_without_lora

    b13 = ctx.w13_lora_b_stacked
    foldable = (swiglu and len(b13) == 1 and b13[0].shape[-2] == y13.shape[1] == 2 * act.shape[1]
                and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous())
    step = _gate_up(ctx, y13, x, topk_ids, act=act if foldable else None, row_map=row_map)
    done = step is not _SKIP and step.act_done
    if done and not live.covers_all_tokens(ctx.w13_lora_a_stacked[0], x.size(0)):
        # the expand wrote the rows with expert LoRA: the others from the GEMM's output
        meta = ctx.punica_wrapper.token_mapping_meta
        swiglu_rows_without_lora(act, y13, topk_ids, meta.token_lora_mapping[: x.size(0)],
                                 ctx.adapter_enabled[: ctx.max_loras], ctx.local_num_experts,
                                 row_map=row_map)
    return (step, None, None, None), done


def _apply_w13_lora(self, lora_context, *, y, x, topk_ids, topk_weights, expert_map, w1, w2,
                    num_tokens, top_k_num, add_inputs=True):
    ctx = lora_context
    if not _ours_applies(ctx, x, expert_map):
        return _vllm["apply_w13_lora"](
            self, ctx, y=y, x=x, topk_ids=topk_ids, topk_weights=topk_weights,
            expert_map=expert_map, w1=w1, w2=w2, num_tokens=num_tokens, top_k_num=top_k_num,
            add_inputs=add_inputs)
    step = _gate_up(ctx, y.view(num_tokens * top_k_num, -1), x,
                    topk_ids.view(num_tokens, top_k_num), add_inputs)
    return step, None, None, None


def _apply_w2_lora(self, lora_context, *, y, x, topk_weights, sorted_token_ids_lora,
                   expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens,
                   w1, w2, top_k_num, add_inputs=True):
    from kernels.moe_lora.layer import MoELoRAStep

    step = sorted_token_ids_lora
    if step is _SKIP:
        return None
    if not isinstance(step, MoELoRAStep):
        return _vllm["apply_w2_lora"](
            self, lora_context, y=y, x=x, topk_weights=topk_weights,
            sorted_token_ids_lora=sorted_token_ids_lora, expert_ids_lora=expert_ids_lora,
            num_tokens_post_padded_lora=num_tokens_post_padded_lora,
            token_lora_mapping=token_lora_mapping, num_tokens=num_tokens, w1=w1, w2=w2,
            top_k_num=top_k_num, add_inputs=add_inputs)
    rows = num_tokens * top_k_num
    step.down(y.view(rows, -1), x.view(rows, -1), topk_weights.view(num_tokens, top_k_num),
              add_inputs=add_inputs)
    return None


def install(patches: Patches) -> None:
    """Swaps the MoE-LoRA methods of ``LoRAExpertsMixin`` and adds the warm-up to
    ``FusedMoEWithLoRA.set_mapping`` (the caller checks the vLLM version)."""
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    _vllm["apply_w13_lora"] = patches.replace(LoRAExpertsMixin, "apply_w13_lora", _apply_w13_lora)
    _vllm["apply_w2_lora"] = patches.replace(LoRAExpertsMixin, "apply_w2_lora", _apply_w2_lora)
    patches.wrap(FusedMoEWithLoRA, "set_mapping", warm_up_after)


def reset() -> None:
    """Forgets the per-layer state (after the patches are undone)."""
    _supported.clear()
    _layers.clear()
    _vllm.clear()
