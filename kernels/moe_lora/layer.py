"""One MoE layer's LoRA applied step after step (what the vLLM integration calls per layer):
``layer.gate_up(...)`` then ``step.down(...)`` on one block layout.

The first step of a layout goes through ``MoELoRAOps`` (sort, the four ops). For a sorted
layout (prefill sizes: steps that run without CUDA graphs, whose CPU cost is on the critical
path) the layer then keeps what that step launched: the block tables' buffer plan, the align
launch(es) and each projection's shrink/expand pair. A later step whose token count has the same
config and ``layout_key`` (token counts within one block grain: a server's steps, whose counts
differ by a few decode tokens, share one) checks one key and the 16-byte alignment of its
tensors, allocates the tables and partials and launches: no per-op key, no launch preparation.
Naive and fused layouts (decode, inside CUDA graphs) always take ``MoELoRAOps``. Nothing of a
step is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.launch.cached import PlanTable, aligned16, raw_stream
from kernels.lora_tiles import as_slices
from kernels.moe_lora.align import (
    MoELoRABlocks,
    block_layout,
    launch_align,
    layout_key,
    layout_tables,
)
from kernels.moe_lora.ops import MoELoRAOps


class MoELoRALayer:
    """The stacks of one MoE layer: gate_up ``A [L, E, r, H]`` / ``B [L, E, N, r]`` in 1 or 2
    slices, down ``A [L, E, r, I]`` / ``B [L, E, H, r]``; ``num_experts`` local experts,
    ``num_slots`` adapter slots."""

    MAX_CALLS = 64
    MAX_CONFIGS = 8192  # token counts whose config is kept (a server's max batched tokens)

    def __init__(self, a13: torch.Tensor | Sequence[torch.Tensor],
                 b13: torch.Tensor | Sequence[torch.Tensor], a2: torch.Tensor,
                 b2: torch.Tensor, num_experts: int, num_slots: int) -> None:
        self.a13, self.b13, self.a2, self.b2 = as_slices(a13), as_slices(b13), a2, b2
        self.num_experts, self.num_slots = num_experts, num_slots
        self.hidden, self.rank = self.a13[0].shape[-1], self.a13[0].shape[-2]
        self.intermediate = a2.shape[-1]
        self.aligned = aligned16(*self.a13, *self.b13, a2, b2)
        self._up = PlanTable(self.MAX_CALLS)
        self._down = PlanTable(self.MAX_CALLS)
        self._configs: dict[tuple[int, int], tuple[dict, int]] = {}

    def gate_up(self, y13: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                token_lora: torch.Tensor, enabled: torch.Tensor, add_inputs: bool = True,
                act: torch.Tensor | None = None,
                row_map: torch.Tensor | None = None, slot_ranks: bool = False) -> "MoELoRAStep":
        """``y13 [M*K, 2I] (+)= (x [M, H] A13^T) B13^T`` for the rows with expert LoRA
        (``topk_ids [M, K]``, ``token_lora [>=M]`` slot or -1, ``enabled [L]``); returns the
        step, for ``down``. ``act [M*K, I]``: those rows' GPT-OSS swiglu goes there instead
        (``step.act_done``; not for two gate/up slices or the fused tiny-batch launch, which
        add into ``y13`` as without it). ``row_map [M*K]`` int32: the rows of ``y13``, ``act``
        and down's input are at ``row_map[t*K+k]`` (``kernels.moe_lora.kernels``); the step
        keeps it for ``down``. ``slot_ranks``: ``enabled`` holds each slot's adapter rank
        (``MoELoRABlocks.slot_ranks``)."""
        m, k = topk_ids.shape
        cfg, sig = self._config(m, k, topk_ids.device)
        extra = tuple(t for t in (act, row_map) if t is not None)
        fast = (not cfg["naive"] and self.aligned and topk_ids.is_contiguous()
                and topk_ids.dtype == token_lora.dtype == enabled.dtype == torch.int32
                and (row_map is None or (row_map.dtype == torch.int32
                                         and row_map.is_contiguous()))
                and aligned16(x, y13, topk_ids, token_lora, enabled, *extra))
        call = key = None
        if fast:
            key = (layout_key(m * k, enabled.shape[0] * self.num_experts, cfg["block_m"],
                              bool(cfg.get("align_parallel"))),
                   sig, k, enabled.shape[0], x.stride(0), y13.stride(0),
                   x.dtype, y13.dtype, add_inputs,
                   None if act is None else (act.stride(0), act.dtype), row_map is not None,
                   slot_ranks)
            call = self._up.get(key)
        if call is None:
            ops = MoELoRAOps(topk_ids, token_lora, enabled, num_experts=self.num_experts,
                             hidden=self.hidden, intermediate=self.intermediate,
                             rank=self.rank, num_slots=self.num_slots, config=cfg,
                             slot_ranks=slot_ranks)
            act_done = ops.add_w13(y13, x, self.a13, self.b13, add_inputs=add_inputs, act=act,
                                   row_map=row_map, down_a=self.a2)
            bl = ops.blocks
            # a step whose down shrink folded into the gate_up expand is not kept (its launches
            # write the down's partials: decode sizes, inside CUDA graphs)
            keep = fast and not ops.fused and not bl.naive and ops.down_part is None
            if (keep and bl.align_plans and ops.launches13 is not None
                    and None not in ops.launches13):
                layout = block_layout(bl.num_rows, enabled.shape[0] * self.num_experts,
                                      bl.block_m, len(bl.align_plans) == 2)
                self._up.put(key, (layout, bl.align_plans, *ops.launches13, ops.cfg,
                                   ops.use_pdl, act_done))
            return MoELoRAStep(self, ops, keep, act_done, row_map, sig)
        (max_blocks, starts, sizes), align_plans, shrink, expand, cfg, pdl, act_done = call
        dev = x.device
        tables = layout_tables(torch.empty(starts[-1], dtype=torch.int32, device=dev), starts,
                               sizes)
        stream = raw_stream(dev)
        launch_align(align_plans, stream, (topk_ids, token_lora, enabled, m * k, k,
                                           self.num_experts), tables)
        cursor, num_blocks, block_pair, block_nrows, sorted_rows, _ = tables
        blocks = (sorted_rows, block_pair, block_nrows, num_blocks, topk_ids, token_lora,
                  enabled)
        part = torch.empty(shrink.extra, dtype=torch.float32, device=dev)
        shrink.launch(stream, x, self.a13[0], self.a13[-1], part, *blocks, topk_ids)
        expand.launch(stream, y13, act if act_done else y13, self.b13[0], self.b13[-1], part,
                      part, part, part, part, *blocks, topk_ids if row_map is None else row_map)
        layout = MoELoRABlocks(sorted_rows, block_pair, block_nrows, num_blocks, max_blocks,
                               cfg["block_m"], m * k, k, self.num_experts, False, topk_ids,
                               token_lora, enabled, align_plans, slot_ranks)
        return MoELoRAStep(self, MoELoRAOps.from_blocks(layout, cfg, pdl), True, act_done,
                           row_map, sig)

    def _config(self, m: int, top_k: int, device: torch.device) -> tuple[dict, int]:
        """The layer config for ``m`` tokens and its signature id (``_signature_id``), looked
        up once per token count (a lookup per layer and step otherwise)."""
        got = self._configs.get((m, top_k))
        if got is None:
            cfg = MoELoRAOps.config_for(m, hidden=self.hidden, intermediate=self.intermediate,
                                        num_experts=self.num_experts, top_k=top_k,
                                        rank=self.rank, num_slots=self.num_slots, device=device)
            if len(self._configs) >= self.MAX_CONFIGS:
                self._configs.clear()
            got = self._configs[(m, top_k)] = (cfg, _signature_id(cfg))
        return got


class MoELoRAStep:
    """One step's block layout and config (``MoELoRAOps``), from ``MoELoRALayer.gate_up`` to
    ``down``; ``fast``: its tensors allow the layer's kept launches; ``act_done``: gate_up
    wrote the activation of its rows (``act``) instead of adding into ``y13``; ``row_map``:
    where down's input rows are (None: ``t*K+k`` order)."""

    __slots__ = ("layer", "ops", "fast", "act_done", "row_map", "sig")

    def __init__(self, layer: MoELoRALayer, ops: MoELoRAOps, fast: bool,
                 act_done: bool = False, row_map: torch.Tensor | None = None,
                 sig: int | None = None) -> None:
        self.layer, self.ops, self.fast, self.act_done = layer, ops, fast, act_done
        self.row_map = row_map
        self.sig = _signature_id(ops.cfg) if sig is None else sig

    def down(self, y2: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor,
             add_inputs: bool = True) -> None:
        """``y2 [M*K, H] (+)= w * (h [M*K, I] A2^T) B2^T`` for the rows of the layout, ``w``
        from ``topk_weights [M, K]``; ``h``'s rows at the step's row map, if any."""
        layer, ops, rmap = self.layer, self.ops, self.row_map
        bl = ops.blocks
        tw = topk_weights.reshape(-1)
        key = (bl.max_blocks, bl.block_m, self.sig, ops.use_pdl, bl.top_k, h.stride(0),
               y2.stride(0), h.dtype, y2.dtype, tw.dtype, add_inputs, rmap is not None,
               bl.slot_ranks)
        fast = self.fast and aligned16(h, y2, tw)
        call = layer._down.get(key) if fast else None
        if call is None:
            ops.add_w2(y2, h, layer.a2, layer.b2, topk_weights, add_inputs=add_inputs,
                       row_map=rmap)
            if fast and ops.launches2 is not None and None not in ops.launches2:
                layer._down.put(key, ops.launches2)
            return
        shrink, expand = call
        blocks = (bl.sorted_rows, bl.block_pair, bl.block_nrows, bl.num_blocks, bl.topk_ids,
                  bl.token_lora, bl.enabled)
        stream = raw_stream(h.device)
        part = torch.empty(shrink.extra, dtype=torch.float32, device=h.device)
        shrink.launch(stream, h, layer.a2, layer.a2, part, *blocks,
                      bl.topk_ids if rmap is None else rmap)
        expand.launch(stream, y2, y2, layer.b2, layer.b2, part, part, tw, part, part, *blocks,
                      bl.topk_ids)


_SIGNATURES: dict[tuple, int] = {}


def _signature_id(cfg: dict) -> int:
    """A small int standing for what of a layer config a kept step depends on (configs are
    looked up per token count: equal ones of two counts are different objects, and hashing
    their op configs per call costs more than the lookup it keys)."""
    sig = (cfg["block_m"], bool(cfg.get("pdl")), bool(cfg.get("align_parallel")),
           cfg["shrink13"], cfg["expand13"], cfg["shrink2"], cfg["expand2"])
    return _SIGNATURES.setdefault(sig, len(_SIGNATURES))
