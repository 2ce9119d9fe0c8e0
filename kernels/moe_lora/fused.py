"""One launch per projection for tiny batches: shrink and expand fused, one row per program.

For a handful of tokens the split shrink/expand pair is two launches whose cost is mostly
latency (each waits for its loads, the second for the first). Here program ``(row, part,
slice)`` computes the row's rank-r intermediate itself (``x[row] · A[slot, expert]^T`` over the
whole input, fp32 on CUDA cores: no tensor-core tile is worth it for one row) and adds its part
of ``inter · B^T`` to ``y[row]``: A is read by the ``parts`` programs of a row (from L2 after the
first), B and y once. Semantics equal ``moe_lora_shrink`` + ``moe_lora_expand`` in the naive
layout (``MoELoRABlocks.naive``): row ``t*K+k`` reads ``x[(t*K+k) // x_row_div]``, slice ``s``
writes columns ``[s*N, (s+1)*N)``, optional per-slot scale and routing weight, add or overwrite;
with a row map (``kernels.moe_lora.kernels``), ``x`` (down) or ``y`` (gate_up) rows in
the base backend's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.launch.cached import CachedLauncher, cdiv
from kernels.lora_tiles import (
    as_slices,
    fit_tile,
    rank_limit,
    rank_pad,
    reads_slot_ranks,
    row_map_arg,
)
from kernels.moe_lora.align import MoELoRABlocks


@triton.jit
def _moe_lora_fused_kernel(
    y_ptr, x_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, scale_ptr, topk_w_ptr,
    topk_ids_ptr, token_lora_ptr, enabled_ptr, row_map_ptr, top_k, x_row_div,
    in_features, out_features, rank, n_per_part,
    stride_xm, stride_al, stride_ae, stride_ar, stride_ym, stride_bl, stride_be, stride_bn,
    RP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SLICES: tl.constexpr,
    HAS_SCALE: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    X_MAP: tl.constexpr, Y_MAP: tl.constexpr, SLOT_RANKS: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    pid_slice = tl.program_id(2)
    expert = tl.load(topk_ids_ptr + row)
    slot = tl.load(token_lora_ptr + row // top_k)
    enabled = tl.load(enabled_ptr + tl.maximum(slot, 0))
    if (slot < 0) | (expert < 0) | (enabled == 0):
        return
    a_base = a0_ptr
    b_base = b0_ptr
    if NUM_SLICES == 2:
        if pid_slice == 1:
            a_base = a1_ptr
            b_base = b1_ptr
    a_base += slot.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    b_base += slot.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    offs_r = tl.arange(0, RP)
    r_lim = rank
    if SLOT_RANKS:  # ``enabled`` holds the slot's adapter rank (``MoELoRABlocks.slot_ranks``)
        r_lim = rank_limit(rank, enabled)
    r_ok = offs_r < r_lim
    x_row = row
    if X_MAP:
        x_row = tl.load(row_map_ptr + row)
    x_base = x_ptr + (x_row // x_row_div).to(tl.int64) * stride_xm
    inter = tl.zeros([RP], dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        xv = tl.load(x_base + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                     mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        inter += tl.sum(at * xv[None, :], axis=1)
    if HAS_SCALE:
        inter *= tl.load(scale_ptr + slot).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        inter *= tl.load(topk_w_ptr + row).to(tl.float32)
    n_start = part * n_per_part
    n_end = tl.minimum(n_start + n_per_part, out_features)
    y_row = row
    if Y_MAP:
        y_row = tl.load(row_map_ptr + row)
    y_base = y_ptr + y_row.to(tl.int64) * stride_ym + pid_slice * out_features
    for n in range(n_start, n_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        d = tl.sum(bt * inter[None, :], axis=1)
        if ADD_INPUTS:
            d += tl.load(y_base + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_base + offs_n, d.to(y_ptr.dtype.element_ty), mask=n_ok)


_FUSED = CachedLauncher(_moe_lora_fused_kernel)
TARGET_PROGRAMS = 264  # two per SM on an H100/H200


def moe_lora_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor | Sequence[torch.Tensor],
    lora_b: torch.Tensor | Sequence[torch.Tensor],
    blocks: MoELoRABlocks,
    x_row_div: int,
    scaling: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    add_inputs: bool = True,
    block_k: int = 128,
    block_n: int = 64,
    num_warps: int = 4,
    row_map: torch.Tensor | None = None,
    map_rows_of: str | None = None,
) -> None:
    """``y [M*K, >=S*N] (+)= scale * w_row * (x[row // x_row_div] A^T) B^T`` per slice for the
    rows with expert LoRA, in one launch; ``blocks`` must be a naive layout. Shapes as
    ``moe_lora_shrink`` / ``moe_lora_expand``. ``row_map [M*K]`` int32 with ``map_rows_of``
    "x" (down: row ``t*K+k`` reads ``x[row_map[t*K+k]]``) or "y" (gate_up: writes
    ``y[row_map[t*K+k]]``)."""
    assert blocks.naive, "the fused path takes the naive (one row per block) layout"
    a, b = as_slices(lora_a), as_slices(lora_b)
    num_slices = len(a)
    rank, in_features = a[0].shape[-2], a[0].shape[-1]
    out_features = b[0].shape[-2]
    rows = blocks.num_rows
    if rows == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1
    assert all(t.stride(-1) == 1 for t in (*a, *b))
    assert x.shape[-1] >= in_features and y.shape[-1] >= num_slices * out_features
    rp = rank_pad(rank)
    block_n = fit_tile(block_n, out_features)
    parts = max(1, min(cdiv(out_features, block_n), cdiv(TARGET_PROGRAMS, rows * num_slices)))
    n_per_part = cdiv(cdiv(out_features, parts), block_n) * block_n
    parts = cdiv(out_features, n_per_part)
    tw = topk_weights.reshape(-1) if topk_weights is not None else y
    assert row_map is None or map_rows_of in ("x", "y"), map_rows_of
    rm = row_map_arg(row_map, blocks.topk_ids, rows)
    _FUSED(
        (rows, parts, num_slices),
        y, x, a[0], a[-1], b[0], b[-1], scaling if scaling is not None else y, tw,
        blocks.topk_ids, blocks.token_lora, blocks.enabled, rm, blocks.top_k, x_row_div,
        in_features, out_features, rank, n_per_part,
        x.stride(0), a[0].stride(0), a[0].stride(1), a[0].stride(2),
        y.stride(0), b[0].stride(0), b[0].stride(1), b[0].stride(2),
        RP=rp, BLOCK_K=fit_tile(block_k, in_features), BLOCK_N=block_n,
        NUM_SLICES=num_slices, HAS_SCALE=scaling is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None, ADD_INPUTS=add_inputs,
        X_MAP=row_map is not None and map_rows_of == "x",
        Y_MAP=row_map is not None and map_rows_of == "y",
        SLOT_RANKS=reads_slot_ranks(blocks.slot_ranks, rank),
        num_warps=num_warps,
    )
