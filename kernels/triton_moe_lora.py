"""Triton kernels for the four LoRA ops of a MoE layer: gate_up shrink/expand, down shrink/expand.

Rows are sorted into (adapter, expert) blocks by ``kernels.moe_lora_align`` (one launch); then

- shrink: ``part[s, b*BM + i, slice*RP + j] = sum_{k in split s} x[row_i, k] * A[a, e, j, k]``
  (fp32 partial sums, one per split-K part: no atomics, no zero-fill, deterministic),
- expand: ``y[row_i, slice*N + n] += scale_a * (w_row) * sum_j (sum_s part[s, ...]) * B[a, e, n, j]``
  (the split-K reduction is done while loading the expand's left operand; the add is fused;
  with ``act``, GPT-OSS's swiglu of the sum goes to ``act`` instead: ``triton_moe_lora_act``).

Layouts (vLLM's MoE-LoRA stacks, and ``kernels/reference.py``):
``A [L, E, r, in]``, ``B [L, E, N, r]``; ``x`` is ``[M, H]`` for gate_up (row ``t*K+k`` reads token
t) or ``[M*K, I]`` for down; ``y`` is ``[M*K, S*N]`` (``intermediate_cache1/3`` viewed 2-D). A
projection may come in S = 1 or 2 slices (vLLM's per-expert gate/up stacks: separate A and B per
slice, slice s writing columns ``[s*N, (s+1)*N)``); the reference's shared-A gate_up is S = 1.

Row map (``row_map [M*K]`` int32): where a base MoE backend keeps the ``[M*K, ·]`` activations in
its own row order (the MXFP4 experts' expert-sorted rows), row ``t*K+k``'s activation row is
``row_map[t*K+k]``: the down shrink reads ``x`` there and the gate_up expand writes ``y`` / ``act``
there (``ROW_MAP``); routing weights stay indexed by ``t*K+k``.

Every kernel: grids depend only on M (CUDA-graph safe), batch-dependent integers are
``do_not_specialize``, programs of unused blocks exit at once (early exit for batches without
MoE-LoRA), EVEN_K / EVEN_R drop masks, and the expand can be launched with programmatic
dependent launch (PDL) so its B tiles load while the shrink finishes.

``kernels.triton_moe_lora_ops.MoELoRAOps`` runs the four ops of a layer on one block layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.moe_lora_align import MoELoRABlocks
from kernels.triton_launch import (CachedLauncher, LaunchPlans, PreparedLaunch, aligned16, cdiv,
                                    next_pow2, raw_stream)
from kernels.triton_lora_common import as_slices, rank_pad, shrink_tile, split_k_plan
from kernels.reference import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from kernels.triton_moe_lora_act import swiglu_oai
from kernels.triton_moe_lora_configs import OpConfig


@triton.jit
def _program_block(
    pid_b, sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, top_k, num_experts,
    BM: tl.constexpr, NAIVE: tl.constexpr,
):
    """``(live, slot, expert, rows [BM], row_ok [BM])`` of the block this program works on.

    Sorted mode: block ``pid_b`` of the align kernel's table; its four loads are independent (one
    memory latency) and programs past ``num_blocks`` are not live. NAIVE mode (tiny batches, no
    align launch): block ``pid_b`` is row ``pid_b`` alone, live when the row has expert LoRA.
    """
    offs_m = tl.arange(0, BM)
    if NAIVE:
        expert = tl.load(topk_ids_ptr + pid_b)
        slot = tl.load(token_lora_ptr + pid_b // top_k)
        enabled = tl.load(enabled_ptr + tl.maximum(slot, 0))
        live = (slot >= 0) & (expert >= 0) & (enabled != 0)
        rows = pid_b + offs_m * 0
        row_ok = offs_m < 1
    else:
        nblocks = tl.load(num_blocks_ptr)
        pair = tl.load(block_pair_ptr + pid_b)
        nrows = tl.load(block_nrows_ptr + pid_b)
        rows = tl.load(sorted_rows_ptr + pid_b * BM + offs_m)
        live = pid_b < nblocks
        slot = pair // num_experts
        expert = pair % num_experts
        row_ok = offs_m < nrows
    return live, slot, expert, rows, row_ok


@triton.jit(do_not_specialize=["k_per_split"])
def _moe_lora_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, part_ptr,
    sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, row_map_ptr, top_k,
    in_features, rank, num_experts, x_row_div, k_per_split,
    stride_xm, stride_al, stride_ae, stride_ar,
    stride_ps, stride_pm,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_R: tl.constexpr, NUM_SLICES: tl.constexpr,
    NAIVE: tl.constexpr, USE_PDL: tl.constexpr, ROW_MAP: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_slice = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    live, slot, expert, rows, row_ok = _program_block(
        pid_b, sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
        topk_ids_ptr, token_lora_ptr, enabled_ptr, top_k, num_experts, BM, NAIVE)
    if live == 0:
        return
    offs_m = tl.arange(0, BM)
    if ROW_MAP:  # the input's rows are in the base backend's order
        rows = tl.load(row_map_ptr + rows, mask=row_ok, other=0)
    x_rows = (rows // x_row_div).to(tl.int64)
    offs_r = tl.arange(0, RP)
    a_base = a0_ptr
    if NUM_SLICES == 2:
        if pid_slice == 1:
            a_base = a1_ptr
    a_base += slot.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    acc = shrink_tile(x_ptr, a_base, x_rows, row_ok, pid_s * k_per_split, k_per_split,
                      in_features, rank, stride_xm, stride_ar, BM, RP, BLOCK_K, EVEN_K, EVEN_R)
    p_ptrs = (part_ptr + pid_s * stride_ps + (pid_b * BM + offs_m)[:, None] * stride_pm
              + pid_slice * RP + offs_r[None, :])
    tl.store(p_ptrs, acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["split_k"])
def _moe_lora_expand_kernel(
    y_ptr, act_ptr, b0_ptr, b1_ptr, part_ptr, scale_ptr, topk_w_ptr,
    sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, row_map_ptr, top_k,
    out_features, rank, num_experts, split_k,
    stride_ym, stride_am, stride_bl, stride_be, stride_bn,
    stride_ps, stride_pm, swiglu_alpha, swiglu_limit,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_R: tl.constexpr, NUM_SLICES: tl.constexpr,
    HAS_SCALE: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    NAIVE: tl.constexpr, USE_PDL: tl.constexpr, SWIGLU: tl.constexpr, ROW_MAP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_slice = tl.program_id(2)
    # the block table comes from the align kernel, finished before the shrink started, so it,
    # the B tile and the y rows load before the wait for the shrink's partial sums (PDL overlap)
    live, slot, expert, rows, row_ok = _program_block(
        pid_b, sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
        topk_ids_ptr, token_lora_ptr, enabled_ptr, top_k, num_experts, BM, NAIVE)
    if live == 0:
        return
    offs_m = tl.arange(0, BM)
    offs_r = tl.arange(0, RP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < out_features
    b_base = b0_ptr
    if NUM_SLICES == 2:
        if pid_slice == 1:
            b_base = b1_ptr
    b_base += slot.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_r[:, None] + offs_n[None, :] * stride_bn
    if EVEN_N and EVEN_R:
        bt = tl.load(b_ptrs)
    else:
        bt = tl.load(b_ptrs, mask=(offs_r[:, None] < rank) & n_ok[None, :], other=0.0)
    out_rows = rows  # y / act rows: the base backend's order under ROW_MAP
    if ROW_MAP:
        out_rows = tl.load(row_map_ptr + rows, mask=row_ok, other=0)
    y_ptrs = (y_ptr + out_rows.to(tl.int64)[:, None] * stride_ym
              + (pid_slice * out_features + offs_n)[None, :])
    if EVEN_N:
        y_mask = row_ok[:, None]
    else:
        y_mask = row_ok[:, None] & n_ok[None, :]
    if ADD_INPUTS:
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + slot).to(tl.float32)
    p_ptrs = part_ptr + (pid_b * BM + offs_m)[:, None] * stride_pm + pid_slice * RP + offs_r[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    inter = tl.load(p_ptrs, mask=row_ok[:, None], other=0.0)
    for s in range(1, split_k):
        inter += tl.load(p_ptrs + s * stride_ps, mask=row_ok[:, None], other=0.0)
    acc = tl.dot(inter.to(bt.dtype), bt)
    if HAS_SCALE:
        acc *= scale
    if MUL_ROUTED_WEIGHT:
        acc *= w[:, None]
    if ADD_INPUTS:
        acc += y_old.to(tl.float32)
    if SWIGLU:  # act instead of y (one slice, gate/up interleaved: kernels.triton_moe_lora_act)
        z = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the value y would have held
        gate, up = tl.split(tl.reshape(z, (BM, BLOCK_N // 2, 2)))
        offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        a_ptrs = act_ptr + out_rows.to(tl.int64)[:, None] * stride_am + offs_h[None, :]
        a_mask = row_ok[:, None] & (offs_h < out_features // 2)[None, :]
        tl.store(a_ptrs, swiglu_oai(gate, up, swiglu_alpha, swiglu_limit).to(
            act_ptr.dtype.element_ty), mask=a_mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


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
    rm = _row_map_arg(row_map, bl)
    key = (cfg, bl.max_blocks, bl.block_m, bl.naive, bl.top_k, bl.num_experts, x_row_div,
           x.stride(0), x.dtype,
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
        dict(BM=bl.block_m, RP=rp, BLOCK_K=block_k, EVEN_K=even_k, EVEN_R=rank == rp,
             NUM_SLICES=num_slices, NAIVE=bl.naive, USE_PDL=use_pdl, ROW_MAP=row_map is not None,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl),
        lead=5 + len(blocks_args), extra=shape)
    return part, plan


def _row_map_arg(row_map: torch.Tensor | None, blocks: MoELoRABlocks) -> torch.Tensor:
    """The kernels' row-map argument: ``row_map [>=M*K]`` int32, or a placeholder that is
    never read (``ROW_MAP`` off)."""
    if row_map is None:
        return blocks.topk_ids
    assert row_map.dtype == torch.int32 and row_map.is_contiguous(), row_map.dtype
    assert row_map.numel() >= blocks.num_rows, (row_map.shape, blocks.num_rows)
    return row_map


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


def expand_with_plan(y, part, lora_b, blocks, cfg, scaling=None, topk_weights=None,
                     add_inputs=True, use_pdl=False, act=None,
                     swiglu=(SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT),
                     row_map=None) -> PreparedLaunch | None:
    """``moe_lora_expand`` returning the prepared launch it used (None: nothing launched). A
    prepared launch takes ``(y, act, B0, B1, part, scale, weights, *block tables, row map)``
    anew.

    ``act [M*K, N/2]``: write the rows' swiglu ``(alpha, limit)`` activation there instead of
    ``y`` (one slice of N interleaved gate/up columns; ``kernels.triton_moe_lora_act``), at
    the same rows as ``y`` (``row_map``)."""
    b = as_slices(lora_b)
    num_slices = len(b)
    bl = blocks
    if bl.max_blocks == 0:
        return None
    tw = topk_weights.reshape(-1) if topk_weights is not None else part
    sc = scaling if scaling is not None else part
    ac = act if act is not None else y
    rm = _row_map_arg(row_map, bl)
    key = (cfg, bl.max_blocks, bl.block_m, bl.naive, bl.top_k, bl.num_experts, y.stride(0),
           y.dtype, b[0].shape,
           b[0].stride(), num_slices, part.shape, scaling is not None, topk_weights is not None,
           tw.dtype, sc.dtype, add_inputs, use_pdl, act is not None, ac.stride(0), ac.dtype,
           swiglu, row_map is not None,
           aligned16(y, ac, b[0], b[-1], part, sc, tw, bl.topk_ids, bl.token_lora, bl.enabled,
                     rm))
    plan = _EXPAND_PLANS.get(key)
    blocks_args = (bl.sorted_rows, bl.block_pair, bl.block_nrows, bl.num_blocks, bl.topk_ids,
                   bl.token_lora, bl.enabled)
    if plan is not None:
        plan.launch(raw_stream(y.device), y, ac, b[0], b[-1], part, sc, tw, *blocks_args, rm)
        return plan
    out_features, rank = b[0].shape[-2], b[0].shape[-1]
    rp = rank_pad(rank)
    assert y.stride(-1) == 1 and ac.stride(-1) == 1 and all(t.stride(-1) == 1 for t in b)
    assert all(t.shape == b[0].shape and t.stride() == b[0].stride() for t in b)
    assert y.shape[-1] >= num_slices * out_features, (y.shape, num_slices, out_features)
    block_n = min(cfg.block_n, max(16, next_pow2(out_features)))
    if act is not None:
        assert num_slices == 1 and out_features % 2 == 0 and act.shape[-1] >= out_features // 2
    return _EXPAND_PLANS.launch_new(
        key, (cdiv(out_features, block_n), bl.max_blocks, num_slices),
        (y, ac, b[0], b[-1], part, sc, tw, *blocks_args, rm, bl.top_k,
         out_features, rank, bl.num_experts, part.shape[0],
         y.stride(0), ac.stride(0), b[0].stride(0), b[0].stride(1), b[0].stride(2),
         part.stride(0), part.stride(1), float(swiglu[0]), float(swiglu[1])),
        dict(BM=bl.block_m, RP=rp, BLOCK_N=block_n,
             EVEN_N=out_features % block_n == 0, EVEN_R=rank == rp, NUM_SLICES=num_slices,
             HAS_SCALE=scaling is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
             ADD_INPUTS=add_inputs, NAIVE=bl.naive, USE_PDL=use_pdl, SWIGLU=act is not None,
             ROW_MAP=row_map is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
             launch_pdl=use_pdl),
        lead=8 + len(blocks_args))
