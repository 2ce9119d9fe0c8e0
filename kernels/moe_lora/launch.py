"""The four LoRA ops of a MoE layer on the host side: ``moe_lora_shrink`` / ``moe_lora_expand``
(and their ``*_with_plan`` forms returning the prepared launch), launching the Triton kernels of
``kernels.moe_lora.kernels`` (layouts, row map and techniques described there).

A repeat call of a known shape and block layout launches a prepared launch
(``kernels.launch.cached``): no specialisation work on the host. ``MoELoRAOps``
(``kernels.moe_lora.ops``) runs the four ops of a layer on one block layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.launch.cached import (
    CachedLauncher,
    LaunchPlans,
    PreparedLaunch,
    aligned16,
    cdiv,
    raw_stream,
)
from kernels.lora_tiles import (
    as_slices,
    fit_tile,
    rank_pad,
    reads_slot_ranks,
    row_map_arg,
    split_k_plan,
)
from kernels.moe_lora.align import MoELoRABlocks
from kernels.moe_lora.configs import OpConfig
from kernels.moe_lora.kernels import _moe_lora_expand_kernel, _moe_lora_shrink_kernel
from kernels.moe_math import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

_SHRINK_PLANS = LaunchPlans(CachedLauncher(_moe_lora_shrink_kernel))
_EXPAND_PLANS = LaunchPlans(CachedLauncher(_moe_lora_expand_kernel))


def moe_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor | Sequence[torch.Tensor],
    blocks: MoELoRABlocks,
    x_row_div: int,
    cfg: OpConfig,
    use_pdl: bool = False,
    out: torch.Tensor | None = None,
    row_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shrink: ``x [rows_in, >=in]`` with ``A [L, E, r, in]`` per slice (all slices of one
    shape; only the first ``in`` columns of ``x`` are read: a padded base activation works as it
    is) → fp32 partials ``[split_k, max_blocks*BM, S*RP]`` (RP = rank padded to a power of two
    >= 16). Repeat calls of a known shape and block layout launch a prepared launch.

    ``x_row_div``: row ``t*K+k`` reads ``x[(t*K+k) // x_row_div]`` (K for gate_up, 1 for down).
    ``out``: a buffer of at least that size to write the partials into (CUDA-graph reuse).
    ``row_map [M*K]`` int32: row ``t*K+k`` reads ``x[row_map[t*K+k] // x_row_div]`` (module
    docstring).
    """
    return shrink_with_plan(x, lora_a, blocks, x_row_div, cfg, use_pdl, out, row_map)[0]


def shrink_with_plan(x, lora_a, blocks, x_row_div, cfg, use_pdl=False, out=None, row_map=None
                     ) -> tuple[torch.Tensor, PreparedLaunch | None]:
    """``moe_lora_shrink`` and the prepared launch it used (None: nothing launched). A prepared
    launch takes ``(x, A0, A1, part, *block tables, row map)`` anew."""
    a = as_slices(lora_a)
    num_slices = len(a)
    bl = blocks  # its block tables start on 16-byte boundaries by construction (align_moe_lora)
    rm = row_map_arg(row_map, bl.topk_ids, bl.num_rows)
    key = (cfg, bl.max_blocks, bl.block_m, bl.naive, bl.slot_ranks, bl.top_k, bl.num_experts,
           x_row_div, x.stride(0), x.dtype,
           a[0].shape, a[0].stride(), num_slices, use_pdl, row_map is not None,
           aligned16(x, a[0], a[-1], bl.topk_ids, bl.token_lora, bl.enabled, rm),
           out is None or out.data_ptr() & 15 == 0)
    plan = _SHRINK_PLANS.get(key)
    shape = plan.extra if plan is not None else _part_shape(a, bl, cfg)
    if out is None:
        part = torch.empty(shape, dtype=torch.float32, device=x.device)
    else:
        part = out.reshape(-1)[: shape[0] * shape[1] * shape[2]].view(shape)
    if bl.max_blocks == 0:
        return part, None
    blocks_args = (bl.sorted_rows, bl.block_pair, bl.block_nrows, bl.num_blocks, bl.topk_ids,
                   bl.token_lora, bl.enabled)
    if plan is not None:
        plan.launch(raw_stream(x.device), x, a[0], a[-1], part, *blocks_args, rm)
        return part, plan
    rank, in_features = a[0].shape[-2], a[0].shape[-1]
    rp = rank_pad(rank)
    ranked = reads_slot_ranks(bl.slot_ranks, rank)
    block_k, split_k, k_per_split, even_k = split_k_plan(in_features, cfg.block_k, cfg.split_k)
    assert x.stride(-1) == 1 and all(t.stride(-1) == 1 for t in a)
    assert all(t.shape == a[0].shape and t.stride() == a[0].stride() for t in a)
    assert x.shape[-1] >= in_features, (x.shape, in_features)
    plan = _SHRINK_PLANS.launch_new(
        key, (bl.max_blocks, split_k, num_slices),
        (x, a[0], a[-1], part, *blocks_args, rm, bl.top_k,
         in_features, rank, bl.num_experts, x_row_div, k_per_split,
         x.stride(0), a[0].stride(0), a[0].stride(1), a[0].stride(2),
         part.stride(0), part.stride(1)),
        dict(BM=bl.block_m, RP=rp, BLOCK_K=block_k, EVEN_K=even_k,
             EVEN_R=rank == rp and not ranked, NUM_SLICES=num_slices, NAIVE=bl.naive,
             USE_PDL=use_pdl, ROW_MAP=row_map is not None, SLOT_RANKS=ranked,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl),
        lead=5 + len(blocks_args), extra=shape)
    return part, plan


def _part_shape(a: tuple[torch.Tensor, ...], blocks: MoELoRABlocks, cfg: OpConfig
                ) -> tuple[int, int, int]:
    """``[split_k, max_blocks*BM, S*RP]``: the shrink's fp32 partials."""
    split_k = split_k_plan(a[0].shape[-1], cfg.block_k, cfg.split_k)[1]
    return split_k, blocks.max_blocks * blocks.block_m, len(a) * rank_pad(a[0].shape[-2])


def moe_lora_expand(
    y: torch.Tensor,
    part: torch.Tensor,
    lora_b: torch.Tensor | Sequence[torch.Tensor],
    blocks: MoELoRABlocks,
    cfg: OpConfig,
    scaling: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    add_inputs: bool = True,
    use_pdl: bool = False,
    row_map: torch.Tensor | None = None,
) -> None:
    """Expand with the add fused: ``y [M*K, >=S*N] (+)= scale * w_row * part @ B^T`` per slice.

    Slice ``s`` goes to columns ``[s*N, (s+1)*N)``; columns past ``S*N`` (a base MoE backend's
    padding, e.g. Marlin's MXFP4 intermediate rounded up to 128) are left untouched, as vLLM's
    own kernel does. ``B [L, E, N, r]`` per slice (all of one shape); ``scaling [L]`` (None: 1,
    vLLM folds it into B); ``topk_weights [M, K]`` multiplies row ``t*K+k`` by its routing
    weight (down proj) when given. With ``add_inputs=False`` the rows of the blocks are
    overwritten (other rows untouched). Repeat calls of a known shape and block layout launch a
    prepared launch. ``row_map [M*K]`` int32: row ``t*K+k`` goes to ``y[row_map[t*K+k]]``
    (module docstring).
    """
    expand_with_plan(y, part, lora_b, blocks, cfg, scaling, topk_weights, add_inputs, use_pdl,
                     row_map=row_map)


def down_part_for_fold(lora_b13: torch.Tensor | Sequence[torch.Tensor], lora_a2: torch.Tensor,
                       blocks: MoELoRABlocks, cfg13: OpConfig) -> torch.Tensor:
    """The down shrink's fp32 partials ``[n-blocks of gate_up, max_blocks*BM, RP]`` that a
    gate_up expand with the activation writes when it folds the down shrink in
    (``expand_with_plan(..., down_a=, down_part=)``); the down expand reads them as its
    split-K parts."""
    b = as_slices(lora_b13)[0]
    n = b.shape[-2]
    block_n = fit_tile(cfg13.block_n, n)
    return torch.empty((cdiv(n, block_n), blocks.max_blocks * blocks.block_m,
                        rank_pad(lora_a2.shape[-2])), dtype=torch.float32, device=b.device)


def expand_with_plan(y, part, lora_b, blocks, cfg, scaling=None, topk_weights=None,
                     add_inputs=True, use_pdl=False, act=None,
                     swiglu=(SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT),
                     row_map=None, down_a=None, down_part=None) -> PreparedLaunch | None:
    """``moe_lora_expand`` returning the prepared launch it used (None: nothing launched). A
    prepared launch takes ``(y, act, B0, B1, part, scale, weights, A2, part2, *block tables,
    row map)`` anew.

    ``act [M*K, N/2]``: write the rows' swiglu ``(alpha, limit)`` activation there instead of
    ``y`` (one slice of N interleaved gate/up columns; ``kernels.moe_lora.activation``), at
    the same rows as ``y`` (``row_map``). With ``act``, ``down_a`` (the down projection's ``A
    [L, E, r, N/2]``) and ``down_part`` (``down_part_for_fold``): the down shrink of those
    activations is folded in, its partials written to ``down_part``."""
    b = as_slices(lora_b)
    num_slices = len(b)
    bl = blocks
    if bl.max_blocks == 0:
        return None
    tw = topk_weights.reshape(-1) if topk_weights is not None else part
    sc = scaling if scaling is not None else part
    ac = act if act is not None else y
    fold = down_a is not None
    assert not fold or (act is not None and down_part is not None)
    a2 = down_a if fold else part
    p2 = down_part if fold else part
    rm = row_map_arg(row_map, bl.topk_ids, bl.num_rows)
    key = (cfg, bl.max_blocks, bl.block_m, bl.naive, bl.slot_ranks, bl.top_k, bl.num_experts,
           y.stride(0), y.dtype, b[0].shape,
           b[0].stride(), num_slices, part.shape, scaling is not None, topk_weights is not None,
           tw.dtype, sc.dtype, add_inputs, use_pdl, act is not None, ac.stride(0), ac.dtype,
           swiglu, row_map is not None, fold, a2.stride() if fold else None, p2.shape,
           aligned16(y, ac, b[0], b[-1], part, sc, tw, a2, p2, bl.topk_ids, bl.token_lora,
                     bl.enabled, rm))
    plan = _EXPAND_PLANS.get(key)
    blocks_args = (bl.sorted_rows, bl.block_pair, bl.block_nrows, bl.num_blocks, bl.topk_ids,
                   bl.token_lora, bl.enabled)
    if plan is not None:
        plan.launch(raw_stream(y.device), y, ac, b[0], b[-1], part, sc, tw, a2, p2,
                    *blocks_args, rm)
        return plan
    out_features, rank = b[0].shape[-2], b[0].shape[-1]
    rp = rank_pad(rank)
    ranked = reads_slot_ranks(bl.slot_ranks, rank)
    assert y.stride(-1) == 1 and ac.stride(-1) == 1 and all(t.stride(-1) == 1 for t in b)
    assert all(t.shape == b[0].shape and t.stride() == b[0].stride() for t in b)
    assert y.shape[-1] >= num_slices * out_features, (y.shape, num_slices, out_features)
    block_n = fit_tile(cfg.block_n, out_features)
    if act is not None:
        assert num_slices == 1 and out_features % 2 == 0 and act.shape[-1] >= out_features // 2
    if fold:
        assert block_n >= 32, "the fold's dot needs 16 activation columns per program"
        assert a2.shape[-1] == out_features // 2 and a2.stride(-1) == 1
        assert a2.shape[-2] == rank, "the fold reads A2 up to the gate_up stack's rank"
        assert p2.shape == (cdiv(out_features, block_n), bl.max_blocks * bl.block_m, rp), \
            (p2.shape, "down_part_for_fold gives the partials' shape")
    p2_strides = (p2.stride(0), p2.stride(1)) if fold else (0, 0)
    a2_strides = (a2.stride(0), a2.stride(1), a2.stride(2)) if fold else (0, 0, 0)
    return _EXPAND_PLANS.launch_new(
        key, (cdiv(out_features, block_n), bl.max_blocks, num_slices),
        (y, ac, b[0], b[-1], part, sc, tw, a2, p2, *blocks_args, rm, bl.top_k,
         out_features, rank, bl.num_experts, part.shape[0],
         y.stride(0), ac.stride(0), b[0].stride(0), b[0].stride(1), b[0].stride(2),
         part.stride(0), part.stride(1), float(swiglu[0]), float(swiglu[1]),
         *a2_strides, *p2_strides),
        dict(BM=bl.block_m, RP=rp, BLOCK_N=block_n,
             EVEN_N=out_features % block_n == 0, EVEN_R=rank == rp and not ranked,
             NUM_SLICES=num_slices,
             HAS_SCALE=scaling is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
             ADD_INPUTS=add_inputs, NAIVE=bl.naive, USE_PDL=use_pdl, SWIGLU=act is not None,
             ROW_MAP=row_map is not None, SLOT_RANKS=ranked, FOLD_DOWN=fold,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl),
        lead=10 + len(blocks_args))
