"""The four MoE-LoRA ops of one layer for one batch (``MoELoRAOps``) and the kernel warm-up.

``MoELoRAOps`` sorts the batch's rows once (``kernels.moe_lora.align``), picks the tuned config
for the device, shape and batch size (``kernels.moe_lora.configs``), and runs the Triton
shrink/expand pairs of ``kernels.moe_lora.launch`` for gate_up and down on that one layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_tiles import as_slices, pdl_supported
from kernels.moe_lora.activation import swiglu_rows_without_lora
from kernels.moe_lora.align import ALIGN_CHUNKS, PARALLEL_CHUNK, align_moe_lora
from kernels.moe_lora.configs import folds_down, get_layer_config
from kernels.moe_lora.fused import moe_lora_fused
from kernels.moe_lora.launch import down_part_for_fold, expand_with_plan, shrink_with_plan


FOLD_MAX_ROWS = 256  # (token, expert) rows up to which the down shrink may fold (decode sizes:
# its partials hold one part per gate_up n-block for every row block)


class MoELoRAOps:
    """The four ops of one MoE layer for one batch, sharing one block layout.

    ``topk_ids [M, K]``, ``token_lora [>=M]`` (-1: no adapter), ``enabled [L]`` (expert LoRA per
    slot; with ``slot_ranks`` the rank of each slot's adapter: ``MoELoRABlocks``). The config
    comes from ``kernels/configs`` for this device and shape (or defaults).
    """

    def __init__(
        self,
        topk_ids: torch.Tensor,
        token_lora: torch.Tensor,
        enabled: torch.Tensor,
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        num_slots: int,
        config: dict | None = None,
        use_pdl: bool | None = None,
        slot_ranks: bool = False,
    ) -> None:
        m, k = topk_ids.shape
        self.cfg = config or get_layer_config(
            m, hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=k,
            rank=rank, num_slots=num_slots, device=topk_ids.device,
        )
        self.use_pdl = (pdl_supported(topk_ids) and bool(self.cfg.get("pdl", False))
                        if use_pdl is None else use_pdl)
        self.blocks = align_moe_lora(topk_ids, token_lora, enabled, num_experts,
                                     int(self.cfg["block_m"]), naive=bool(self.cfg.get("naive")),
                                     parallel=bool(self.cfg.get("align_parallel")),
                                     slot_ranks=slot_ranks)
        self._init_state()

    def _init_state(self) -> None:
        self.fused = self.blocks.naive and bool(self.cfg.get("fused"))
        self.fold_down = (not self.fused and self.blocks.num_rows <= FOLD_MAX_ROWS
                          and folds_down(self.cfg))
        # (shrink, expand) prepared launches of each projection's op pair, once it has run
        # (the shrink's ``extra`` is its partials' shape; None: not launched)
        self.launches13: tuple | None = None
        self.launches2: tuple | None = None
        # the down shrink's partials when the gate_up expand folded it in
        self.down_part: torch.Tensor | None = None

    @staticmethod
    def config_for(num_tokens: int, **shape) -> dict:
        """The layer config these ops pick for ``num_tokens`` and ``shape`` (the keywords of
        ``get_layer_config``)."""
        return get_layer_config(num_tokens, **shape)

    @classmethod
    def from_blocks(cls, blocks, cfg: dict, use_pdl: bool) -> "MoELoRAOps":
        """The ops on a block layout already built (``MoELoRABlocks``) with its config."""
        ops = cls.__new__(cls)
        ops.cfg, ops.use_pdl, ops.blocks = cfg, use_pdl, blocks
        ops._init_state()
        return ops

    def add_w13(self, y13: torch.Tensor, x: torch.Tensor, a13, b13,
                scaling: torch.Tensor | None = None, add_inputs: bool = True,
                act: torch.Tensor | None = None, row_map: torch.Tensor | None = None,
                down_a: torch.Tensor | None = None) -> bool:
        """gate_up: ``y13 [M*K, 2I] (+)= scale * (x A13^T) B13^T`` for rows with expert LoRA;
        with ``act [M*K, I]`` and one slice, those rows' GPT-OSS swiglu is written there instead
        (``kernels.moe_lora.activation``). Returns whether it was (not by the fused tiny-batch
        launch, nor for two slices: they add into ``y13``). ``row_map [M*K]`` int32: row
        ``t*K+k`` of ``y13`` / ``act`` is ``row_map[t*K+k]``
        (``kernels.moe_lora.kernels``). ``down_a`` (the down projection's A): where this layout
        folds the down shrink in (``fold_down``) and ``act`` is written, the expand also computes
        the down shrink of those activations; ``add_w2`` then skips its shrink (it must get
        that ``act`` as its input)."""
        b13 = as_slices(b13)
        if act is not None and (self.fused or len(b13) != 1):
            act = None
        if self.fused:
            moe_lora_fused(y13, x, a13, b13, self.blocks, self.blocks.top_k, scaling=scaling,
                           add_inputs=add_inputs, row_map=row_map, map_rows_of="y")
            return False
        part, shrink = shrink_with_plan(x, a13, self.blocks, self.blocks.top_k,
                                        self.cfg["shrink13"], use_pdl=self.use_pdl)
        fold = self.fold_down and act is not None and down_a is not None
        self.down_part = (down_part_for_fold(b13, down_a, self.blocks, self.cfg["expand13"])
                          if fold else None)
        expand = expand_with_plan(y13, part, b13, self.blocks, self.cfg["expand13"],
                                  scaling=scaling, add_inputs=add_inputs, use_pdl=self.use_pdl,
                                  act=act, row_map=row_map, down_a=down_a if fold else None,
                                  down_part=self.down_part)
        self.launches13 = (shrink, expand)
        return act is not None

    def add_w2(self, y2: torch.Tensor, h: torch.Tensor, a2, b2, topk_weights: torch.Tensor | None,
               scaling: torch.Tensor | None = None, add_inputs: bool = True,
               row_map: torch.Tensor | None = None) -> None:
        """down: ``y2 [M*K, H] (+)= scale * w * (h A2^T) B2^T`` with ``h [M*K, I]`` (row
        ``t*K+k`` of ``h`` at ``row_map[t*K+k]`` when given; ``y2`` in ``t*K+k`` order)."""
        if self.fused:
            moe_lora_fused(y2, h, a2, b2, self.blocks, 1, scaling=scaling,
                           topk_weights=topk_weights, add_inputs=add_inputs, row_map=row_map,
                           map_rows_of="x")
            return
        if self.down_part is not None:  # the gate_up expand did the shrink: no PDL wait
            expand = expand_with_plan(y2, self.down_part, b2, self.blocks, self.cfg["expand2"],
                                      scaling=scaling, topk_weights=topk_weights,
                                      add_inputs=add_inputs, use_pdl=False)
            self.launches2 = (None, expand)
            return
        part, shrink = shrink_with_plan(h, a2, self.blocks, 1, self.cfg["shrink2"],
                                        use_pdl=self.use_pdl, row_map=row_map)
        expand = expand_with_plan(y2, part, b2, self.blocks, self.cfg["expand2"],
                                  scaling=scaling, topk_weights=topk_weights,
                                  add_inputs=add_inputs, use_pdl=self.use_pdl)
        self.launches2 = (shrink, expand)


def warm_up(
    lora_a13: torch.Tensor | Sequence[torch.Tensor],
    lora_b13: torch.Tensor | Sequence[torch.Tensor],
    lora_a2: torch.Tensor,
    lora_b2: torch.Tensor,
    num_experts: int,
    top_k: int,
    configs: Sequence[tuple[int, dict]],
    mxfp4: bool = False,
    slot_ranks: bool = False,
) -> None:
    """Compiles every kernel variant that the layer configs ``[(M, config)]`` can launch, so no
    batch size compiles during serving. Runs each config once at its M on zero inputs (outputs
    go to scratch buffers; the weights are only read), plus the align program at each of its
    row-chunk sizes and the parallel align where a config uses it. ``mxfp4``: the unfused MXFP4
    experts' variants instead (``kernels.vllm.cuda.mxfp4``): every op with a row map, the gate_up
    expand also with the activation folded in, and its complement
    (``kernels.moe_lora.activation``). ``slot_ranks``: the variants reading each slot's rank
    (``MoELoRABlocks.slot_ranks``). Call outside CUDA-graph capture.
    """
    a13, b13 = as_slices(lora_a13), as_slices(lora_b13)
    dev = a13[0].device
    slots, rank, hidden = a13[0].shape[0], a13[0].shape[-2], a13[0].shape[-1]
    inter = lora_a2.shape[-1]
    n13 = sum(b.shape[-2] for b in b13)
    enabled = torch.full((slots,), rank if slot_ranks else 1, dtype=torch.int32, device=dev)

    def routing(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = (torch.arange(m * top_k, device=dev, dtype=torch.int32) % num_experts).view(m, top_k)
        return ids, torch.arange(m, device=dev, dtype=torch.int32) % slots

    for m, cfg in configs:
        ids, lora = routing(m)
        ops = MoELoRAOps(ids, lora, enabled, num_experts, hidden, inter, rank, slots, config=cfg,
                         slot_ranks=slot_ranks)
        y13 = torch.zeros(m * top_k, n13, dtype=a13[0].dtype, device=dev)
        x = torch.zeros(m, hidden, dtype=a13[0].dtype, device=dev)
        rmap = (torch.arange(m * top_k - 1, -1, -1, dtype=torch.int32, device=dev)
                if mxfp4 else None)
        ops.add_w13(y13, x, a13, b13, row_map=rmap)
        if mxfp4 and len(b13) == 1:
            act = torch.empty(m * top_k, n13 // 2, dtype=a13[0].dtype, device=dev)
            ops.add_w13(y13, x, a13, b13, act=act, row_map=rmap, down_a=lora_a2)
            swiglu_rows_without_lora(act, y13, ids, lora, enabled, num_experts, row_map=rmap)
            if ops.down_part is not None:  # the folded down's expand
                ops.add_w2(torch.zeros(m * top_k, hidden, dtype=a13[0].dtype, device=dev), act,
                           lora_a2, lora_b2, torch.ones(m, top_k, device=dev), row_map=rmap)
                ops.down_part = None
        y2 = torch.zeros(m * top_k, hidden, dtype=a13[0].dtype, device=dev)
        ops.add_w2(y2, torch.zeros(m * top_k, inter, dtype=a13[0].dtype, device=dev), lora_a2,
                   lora_b2, torch.ones(m, top_k, device=dev), row_map=rmap)
    for bm in sorted({int(cfg["block_m"]) for _, cfg in configs if not cfg.get("naive")}):
        for chunk in ALIGN_CHUNKS:
            ids, lora = routing(max(1, chunk // top_k))
            align_moe_lora(ids, lora, enabled, num_experts, bm)
    for bm in sorted({int(cfg["block_m"]) for _, cfg in configs if cfg.get("align_parallel")}):
        ids, lora = routing(max(1, PARALLEL_CHUNK // top_k))
        align_moe_lora(ids, lora, enabled, num_experts, bm, parallel=True)
