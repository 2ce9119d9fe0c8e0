"""Triton kernels for the four LoRA ops of a MoE layer: gate_up shrink/expand, down shrink/expand.

Rows are sorted into (adapter, expert) blocks by ``kernels.moe_lora.align`` (one launch); then

- shrink: ``part[s, b*BM + i, slice*RP + j] = sum_{k in split s} x[row_i, k] * A[a, e, j, k]``
  (fp32 partial sums, one per split-K part: no atomics, no zero-fill, deterministic),
- expand: ``y[row_i, slice*N + n] += scale_a * (w_row) * sum_j (sum_s part[s, ...]) * B[a, e, n, j]``
  (the split-K reduction is done while loading the expand's left operand; the add is fused;
  with ``act``, GPT-OSS's swiglu of the sum goes to ``act`` instead: ``triton_moe_lora_act``;
  with FOLD_DOWN also the down shrink of those ``act`` columns, ``part2[n-block, row, j] =
  sum_{c in the block} act[row, c] * A2[a, e, j, c]``: the down expand then reads these
  partials, one per gate_up n-block, and the down shrink launch is gone).

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
MoE-LoRA), EVEN_K / EVEN_R drop masks, with SLOT_RANKS ``enabled [L]`` holds each slot's
adapter rank (0: none) and A rows / B columns past it are not read (a rank-16 adapter in a
rank-64 stack moves a quarter of the bytes), and the expand can be launched with programmatic
dependent launch (PDL) so its B tiles load while the shrink finishes.

``kernels.moe_lora.launch`` launches them (``moe_lora_shrink`` / ``moe_lora_expand``);
``kernels.moe_lora.ops.MoELoRAOps`` runs the four ops of a layer on one block layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.lora_tiles import shrink_tile, slot_rank, split_k_sum
from kernels.moe_lora.activation import swiglu_oai


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
    SLOT_RANKS: tl.constexpr,
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
    r_lim = slot_rank(rank, enabled_ptr, slot, SLOT_RANKS)
    acc = shrink_tile(x_ptr, a_base, x_rows, row_ok, pid_s * k_per_split, k_per_split,
                      in_features, r_lim, stride_xm, stride_ar, BM, RP, BLOCK_K, EVEN_K, EVEN_R)
    p_ptrs = (part_ptr + pid_s * stride_ps + (pid_b * BM + offs_m)[:, None] * stride_pm
              + pid_slice * RP + offs_r[None, :])
    tl.store(p_ptrs, acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["split_k"])
def _moe_lora_expand_kernel(
    y_ptr, act_ptr, b0_ptr, b1_ptr, part_ptr, scale_ptr, topk_w_ptr, a2_ptr, part2_ptr,
    sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, row_map_ptr, top_k,
    out_features, rank, num_experts, split_k,
    stride_ym, stride_am, stride_bl, stride_be, stride_bn,
    stride_ps, stride_pm, swiglu_alpha, swiglu_limit,
    stride_a2l, stride_a2e, stride_a2r, stride_p2s, stride_p2m,
    BM: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_R: tl.constexpr, NUM_SLICES: tl.constexpr,
    HAS_SCALE: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    NAIVE: tl.constexpr, USE_PDL: tl.constexpr, SWIGLU: tl.constexpr, ROW_MAP: tl.constexpr,
    SLOT_RANKS: tl.constexpr, FOLD_DOWN: tl.constexpr,
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
        r_lim = slot_rank(rank, enabled_ptr, slot, SLOT_RANKS)
        bt = tl.load(b_ptrs, mask=(offs_r[:, None] < r_lim) & n_ok[None, :], other=0.0)
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
    p_ptrs = (part_ptr + (pid_b * BM + offs_m)[:, None] * stride_pm + pid_slice * RP
              + offs_r[None, :])
    inter = split_k_sum(p_ptrs, row_ok, split_k, stride_ps, USE_PDL)
    acc = tl.dot(inter.to(bt.dtype), bt)
    if HAS_SCALE:
        acc *= scale
    if MUL_ROUTED_WEIGHT:
        acc *= w[:, None]
    if ADD_INPUTS:
        acc += y_old.to(tl.float32)
    if SWIGLU:  # act instead of y (one slice, gate/up interleaved: kernels.moe_lora.activation)
        z = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the value y would have held
        gate, up = tl.split(tl.reshape(z, (BM, BLOCK_N // 2, 2)))
        offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        a_ptrs = act_ptr + out_rows.to(tl.int64)[:, None] * stride_am + offs_h[None, :]
        h_ok = offs_h < out_features // 2
        h = swiglu_oai(gate, up, swiglu_alpha, swiglu_limit).to(act_ptr.dtype.element_ty)
        tl.store(a_ptrs, h, mask=row_ok[:, None] & h_ok[None, :])
        if FOLD_DOWN:  # the down shrink of these act columns: split-K part pid_n of its partials
            r2_lim = slot_rank(rank, enabled_ptr, slot, SLOT_RANKS)
            a2_ptrs = (a2_ptr + slot.to(tl.int64) * stride_a2l + expert.to(tl.int64) * stride_a2e
                       + offs_r[:, None] * stride_a2r + offs_h[None, :])
            a2t = tl.load(a2_ptrs, mask=(offs_r[:, None] < r2_lim) & h_ok[None, :], other=0.0)
            hp = tl.dot(tl.where(h_ok[None, :], h, 0.0).to(a2t.dtype), tl.trans(a2t))
            p2_ptrs = (part2_ptr + pid_n * stride_p2s
                       + (pid_b * BM + offs_m)[:, None] * stride_p2m + offs_r[None, :])
            tl.store(p2_ptrs, hp, mask=row_ok[:, None])
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
