"""Triton kernels for dense (attention / MLP projection) LoRA: shrink and expand, 1–3 slices.

The batch's tokens come grouped by adapter slot the way vLLM's punica metadata holds them
(``LoRAKernelMeta``, prepared once per step outside CUDA graphs): ``sorted_idx [M]`` token ids
grouped by slot, and per group ``g`` its slot ``group_slot[g]`` (-1: no adapter), token count
``group_ntok[g]`` and first position ``group_start[g]``. The row axis is compact: groups with a
live slot get ``ceil(ntok/BM)`` blocks each, numbered group after group (each program finds its
group from the G token counts, a prefix sum over at most a few dozen values), so the grid is
``ceil(M/BM) + G - 1`` programs, not ``G * ceil(M/BM)``, and programs past the last block exit
at once. Then

- shrink: ``part[s, p, slice*RP + r] = scale * sum_{k in split s} x[sorted_idx[p], k] *
  A[slot, r, k]``
  (fp32 partials at the token's sorted position ``p``: no atomics, no zero-fill);
- expand: ``y[t, off_slice + n] (+)= sum_r (sum_s part[s, p, slice*RP + r]) * B[slot, n, r]``
  (split-K reduction while loading, the add fused; PDL lets B and y load during the shrink);
- fused (decode sizes): both in one launch, each expand program computing its rows' shrink over
  all of K (no partials, one launch instead of two).

Layouts (vLLM's dense LoRA stacks): ``A [L, 1, r, in]`` and ``B [L, 1, N_slice, r]`` per slice,
slice ``i`` writing columns ``[sum(N_<i), sum(N_<=i))`` of ``y [M, >= sum(N)]``. Grids depend
only on M (CUDA-graph safe); M-dependent integers are not specialised on. With ``slot_live [L]``
(HAS_LIVE) each slot's entry is its adapter's rank for the layer: 0 skips the slot, otherwise
(LIVE_RANKS: the stack's rank a whole number of 16s) A rows and B columns are read up to it,
rounded up to 16 (``kernels.lora_tiles.rank_limit``; the stack is zero past it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.lora_tiles import shrink_tile, slot_rank, split_k_sum


@triton.jit
def _group_block(pid_b, num_groups, num_tokens, sorted_idx_ptr, group_slot_ptr, group_ntok_ptr,
                 group_start_ptr, slot_live_ptr, BM: tl.constexpr, G_P2: tl.constexpr,
                 HAS_LIVE: tl.constexpr):
    """``(live, slot, rows [BM], pos [BM], row_ok [BM])`` of row-block program ``pid_b``: block
    ``pid_b`` of the compact numbering over the groups with a live slot (slot >= 0 and, with
    HAS_LIVE, a non-zero ``slot_live`` entry: its adapter has weights for this layer, of that
    rank)."""
    offs_g = tl.arange(0, G_P2)
    g_ok = offs_g < num_groups
    slots = tl.load(group_slot_ptr + offs_g, mask=g_ok, other=-1)
    ntoks = tl.load(group_ntok_ptr + offs_g, mask=g_ok, other=0)
    on = slots >= 0
    if HAS_LIVE:
        on = on & (tl.load(slot_live_ptr + tl.maximum(slots, 0), mask=g_ok, other=0) != 0)
    nblk = tl.where(on, (ntoks + BM - 1) // BM, 0)
    cum = tl.cumsum(nblk, 0)  # inclusive: group g owns blocks [cum[g] - nblk[g], cum[g])
    group = tl.sum((cum <= pid_b).to(tl.int32), 0)
    live = group < num_groups
    this = offs_g == group
    first = (pid_b - tl.sum(tl.where(this, cum - nblk, 0), 0)) * BM
    slot = tl.sum(tl.where(this, slots, 0), 0)
    ntok = tl.sum(tl.where(this, ntoks, 0), 0)
    start = tl.load(group_start_ptr + tl.minimum(group, num_groups - 1))
    offs_m = tl.arange(0, BM)
    pos = start + first + offs_m
    # (the group test broadcast to the block first: the interpreter rejects a mask combined
    # from a reduction's scalar and a block)
    row_ok = ((first + offs_m) < ntok) & (pos < num_tokens) & ((offs_m * 0 + group) < num_groups)
    rows = tl.load(sorted_idx_ptr + pos, mask=row_ok, other=0)
    return live, slot, rows, pos, row_ok


@triton.jit(do_not_specialize=["num_tokens"])
def _dense_lora_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, part_ptr,
    sorted_idx_ptr, group_slot_ptr, group_ntok_ptr, group_start_ptr, slot_live_ptr,
    num_groups, num_tokens, in_features, rank, k_per_split, scale,
    stride_xm, stride_al, stride_ar, stride_ps, stride_pm,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_R: tl.constexpr, NUM_SLICES: tl.constexpr, HAS_SCALE: tl.constexpr, G_P2: tl.constexpr,
    HAS_LIVE: tl.constexpr, USE_PDL: tl.constexpr, LIVE_RANKS: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_slice = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    live, slot, rows, pos, row_ok = _group_block(
        pid_b, num_groups, num_tokens, sorted_idx_ptr, group_slot_ptr, group_ntok_ptr,
        group_start_ptr, slot_live_ptr, BM, G_P2, HAS_LIVE)
    if live == 0:
        return
    a_base = a0_ptr
    if NUM_SLICES >= 2:
        if pid_slice == 1:
            a_base = a1_ptr
    if NUM_SLICES == 3:
        if pid_slice == 2:
            a_base = a2_ptr
    a_base += slot.to(tl.int64) * stride_al
    offs_r = tl.arange(0, RP)
    r_lim = slot_rank(rank, slot_live_ptr, slot, LIVE_RANKS)
    acc = shrink_tile(x_ptr, a_base, rows.to(tl.int64), row_ok, pid_s * k_per_split,
                      k_per_split, in_features, r_lim, stride_xm, stride_ar, BM, RP, BLOCK_K,
                      EVEN_K, EVEN_R)
    if HAS_SCALE:
        acc *= scale
    p_ptrs = (part_ptr + pid_s * stride_ps + pos.to(tl.int64)[:, None] * stride_pm
              + pid_slice * RP + offs_r[None, :])
    tl.store(p_ptrs, acc, mask=row_ok[:, None])


@triton.jit
def _pick_slice(pid_slice, p0, p1, p2, n0, n1, n2, NUM_SLICES: tl.constexpr):
    """``(p_i, n_i, col0_i)`` of slice ``i = pid_slice``: its pointer (or stride), its width,
    its first output column (the widths before it)."""
    p = p0
    n = n0
    if NUM_SLICES >= 2:
        if pid_slice == 1:
            p = p1
            n = n1
    if NUM_SLICES == 3:
        if pid_slice == 2:
            p = p2
            n = n2
    col0 = tl.where(pid_slice >= 1, n0, 0) + tl.where(pid_slice >= 2, n1, 0)
    return p, n, col0


@triton.jit
def _expand_operands(y_ptr, b_base, rows, row_ok, pid_n, n_slice, col0, r_lim, stride_ym,
                     stride_bn, BM: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_R: tl.constexpr, ADD_INPUTS: tl.constexpr):
    """What an expand tile needs before its left operand: ``(B^T tile [RP, BLOCK_N], y
    pointers, y mask, y's old values or zeros)`` (loaded ahead of the shrink's result: under
    PDL while the shrink still runs)."""
    offs_r = tl.arange(0, RP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_slice
    b_ptrs = b_base + offs_r[:, None] + offs_n[None, :] * stride_bn
    if EVEN_N and EVEN_R:
        bt = tl.load(b_ptrs)
    else:
        bt = tl.load(b_ptrs, mask=(offs_r[:, None] < r_lim) & n_ok[None, :], other=0.0)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + (col0 + offs_n)[None, :]
    if EVEN_N:
        y_mask = row_ok[:, None]
    else:
        y_mask = row_ok[:, None] & n_ok[None, :]
    y_old = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    if ADD_INPUTS:
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    return bt, y_ptrs, y_mask, y_old


@triton.jit
def _expand_store(inter, bt, y_ptrs, y_mask, y_old, ADD_INPUTS: tl.constexpr):
    """``y = (y_old +) inter @ B^T``, ``inter`` (fp32 ``[BM, RP]``) rounded to B's dtype."""
    acc = tl.dot(inter.to(bt.dtype), bt)
    if ADD_INPUTS:
        acc += y_old
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["num_tokens", "split_k"])
def _dense_lora_expand_kernel(
    y_ptr, b0_ptr, b1_ptr, b2_ptr, part_ptr,
    sorted_idx_ptr, group_slot_ptr, group_ntok_ptr, group_start_ptr, slot_live_ptr,
    num_groups, num_tokens, n0, n1, n2, rank, split_k,
    stride_ym, stride_bl0, stride_bl1, stride_bl2, stride_bn, stride_ps, stride_pm,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_R: tl.constexpr, NUM_SLICES: tl.constexpr, ADD_INPUTS: tl.constexpr, G_P2: tl.constexpr,
    HAS_LIVE: tl.constexpr, USE_PDL: tl.constexpr, LIVE_RANKS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_slice = tl.program_id(2)
    b_base, n_slice, col0 = _pick_slice(pid_slice, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2,
                                        NUM_SLICES)
    stride_bl, _, _ = _pick_slice(pid_slice, stride_bl0, stride_bl1, stride_bl2, n0, n1, n2,
                                  NUM_SLICES)
    if pid_n * BLOCK_N >= n_slice:
        return
    live, slot, rows, pos, row_ok = _group_block(
        pid_b, num_groups, num_tokens, sorted_idx_ptr, group_slot_ptr, group_ntok_ptr,
        group_start_ptr, slot_live_ptr, BM, G_P2, HAS_LIVE)
    if live == 0:
        return
    r_lim = slot_rank(rank, slot_live_ptr, slot, LIVE_RANKS)
    bt, y_ptrs, y_mask, y_old = _expand_operands(
        y_ptr, b_base + slot.to(tl.int64) * stride_bl, rows, row_ok, pid_n, n_slice, col0, r_lim,
        stride_ym, stride_bn, BM, RP, BLOCK_N, EVEN_N, EVEN_R, ADD_INPUTS)
    offs_r = tl.arange(0, RP)
    p_ptrs = part_ptr + pos.to(tl.int64)[:, None] * stride_pm + pid_slice * RP + offs_r[None, :]
    inter = split_k_sum(p_ptrs, row_ok, split_k, stride_ps, USE_PDL)
    _expand_store(inter, bt, y_ptrs, y_mask, y_old, ADD_INPUTS)


@triton.jit(do_not_specialize=["num_tokens"])
def _dense_lora_fused_kernel(
    y_ptr, x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr,
    sorted_idx_ptr, group_slot_ptr, group_ntok_ptr, group_start_ptr, slot_live_ptr,
    num_groups, num_tokens, in_features, n0, n1, n2, rank, scale,
    stride_xm, stride_al, stride_ar, stride_ym, stride_bl0, stride_bl1, stride_bl2, stride_bn,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_R: tl.constexpr,
    NUM_SLICES: tl.constexpr, HAS_SCALE: tl.constexpr, ADD_INPUTS: tl.constexpr,
    G_P2: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_RANKS: tl.constexpr,
):
    """Shrink and expand in one launch (decode sizes): program ``(n-block, row block, slice)``
    computes its rows' whole ``[BM, RP]`` shrink over all of K itself (the slot's A is read by
    every n-block of the slice, from L2 after the first) and writes its ``BLOCK_N`` columns.
    Same result as the shrink + expand pair with split-K 1: the fp32 shrink rounded to the
    weights' dtype before the expand."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_slice = tl.program_id(2)
    b_base, n_slice, col0 = _pick_slice(pid_slice, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2,
                                        NUM_SLICES)
    stride_bl, _, _ = _pick_slice(pid_slice, stride_bl0, stride_bl1, stride_bl2, n0, n1, n2,
                                  NUM_SLICES)
    a_base, _, _ = _pick_slice(pid_slice, a0_ptr, a1_ptr, a2_ptr, n0, n1, n2, NUM_SLICES)
    if pid_n * BLOCK_N >= n_slice:
        return
    live, slot, rows, pos, row_ok = _group_block(
        pid_b, num_groups, num_tokens, sorted_idx_ptr, group_slot_ptr, group_ntok_ptr,
        group_start_ptr, slot_live_ptr, BM, G_P2, HAS_LIVE)
    if live == 0:
        return
    r_lim = slot_rank(rank, slot_live_ptr, slot, LIVE_RANKS)
    bt, y_ptrs, y_mask, y_old = _expand_operands(
        y_ptr, b_base + slot.to(tl.int64) * stride_bl, rows, row_ok, pid_n, n_slice, col0, r_lim,
        stride_ym, stride_bn, BM, RP, BLOCK_N, EVEN_N, EVEN_R, ADD_INPUTS)
    inter = shrink_tile(x_ptr, a_base + slot.to(tl.int64) * stride_al, rows.to(tl.int64), row_ok,
                        0, in_features, in_features, r_lim, stride_xm, stride_ar, BM, RP,
                        BLOCK_K, EVEN_K, EVEN_R)
    if HAS_SCALE:
        inter *= scale
    _expand_store(inter, bt, y_ptrs, y_mask, y_old, ADD_INPUTS)
