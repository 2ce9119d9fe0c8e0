"""What the MoE and dense LoRA Triton kernels share: the shrink tile (one block of rows times one
adapter's ``A`` over a K range), the rank padding rule, the split-K plan, slice handling and the
PDL capability check."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.launch.cached import cdiv, next_pow2


def row_map_arg(row_map: torch.Tensor | None, topk_ids: torch.Tensor,
                num_rows: int) -> torch.Tensor:
    """The MoE-LoRA kernels' row-map argument (``kernels.moe_lora.kernels``):
    ``row_map [>=num_rows]`` int32, or ``topk_ids`` as a placeholder the kernels never read
    (their ``ROW_MAP`` off)."""
    rm = topk_ids if row_map is None else row_map
    assert rm.dtype == torch.int32 and rm.is_contiguous(), rm.dtype
    assert rm.numel() >= num_rows, (rm.shape, num_rows)
    return rm


@triton.jit
def split_k_sum(p_ptrs, row_ok, split_k, stride_ps, USE_PDL: tl.constexpr):
    """An expand's left operand ``[BM, RP]``: the shrink's fp32 partial sums at ``p_ptrs``
    added over the ``split_k`` parts (``stride_ps`` apart), loaded after programmatic dependent
    launch's wait for the shrink (``USE_PDL``: everything before the call overlaps it)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    inter = tl.load(p_ptrs, mask=row_ok[:, None], other=0.0)
    for s in range(1, split_k):
        inter += tl.load(p_ptrs + s * stride_ps, mask=row_ok[:, None], other=0.0)
    return inter


RANK_GRAIN = 16  # slot ranks are read in whole runs of this many (``rank_limit``)


@triton.jit
def rank_limit(rank, adapter_rank):
    """How many A rows / B columns of a slot to read: its adapter's rank rounded up to a whole
    ``RANK_GRAIN`` (vLLM zeroes a slot's stack past its adapter's rank, so the rounding reads
    zeros only), at most the stack's ``rank`` (a multiple of the grain). The mask against it is
    then constant over runs of 16 along the rank axis, so loads along that axis (B's rows) stay
    vectorised."""
    return tl.multiple_of(tl.minimum(rank, (adapter_rank + 15) // 16 * 16), 16)


@triton.jit
def slot_rank(rank, ranks_ptr, slot, SLOT_RANKS: tl.constexpr):
    """How many of slot ``slot``'s A rows / B columns a program reads: the stack's ``rank``, or
    with SLOT_RANKS ``rank_limit`` of ``ranks_ptr[slot]``, the rank of the slot's adapter
    (launches set SLOT_RANKS only for a stack rank that is a multiple of ``RANK_GRAIN``)."""
    r = rank
    if SLOT_RANKS:
        r = rank_limit(rank, tl.load(ranks_ptr + slot))
    return r


def reads_slot_ranks(slot_ranks: bool, rank: int) -> bool:
    """Whether a launch reads per-slot ranks (``slot_rank``'s SLOT_RANKS): asked for, and a stack
    rank that is a whole number of ``RANK_GRAIN`` runs (vLLM's 1 and 8 are not: those stacks
    are read whole)."""
    return slot_ranks and rank % RANK_GRAIN == 0


@triton.jit
def shrink_tile(x_ptr, a_base, x_rows, row_ok, k_start, k_len, in_features, rank,
                stride_xm, stride_ar, BM: tl.constexpr, RP: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_R: tl.constexpr):
    """fp32 ``[BM, RP]`` = ``x[x_rows, k_start:k_start+k_len] @ A[:, k_start:...]^T`` for one
    block of rows (``x_rows`` int64 row indices, ``row_ok`` mask) and one adapter's ``A``
    (``a_base``: its ``[r, in]`` matrix; rows from ``rank`` on are not read, their columns of
    the result are 0); masks only where EVEN_K / EVEN_R say so."""
    offs_r = tl.arange(0, RP)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_base + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros([BM, RP], dtype=tl.float32)
    for k in range(k_start, k_start + k_len, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            if EVEN_R:
                at = tl.load(a_ptrs)
            else:
                at = tl.load(a_ptrs, mask=offs_r[:, None] < rank, other=0.0)
        else:
            k_ok = (k + tl.arange(0, BLOCK_K)) < in_features
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=(offs_r[:, None] < rank) & k_ok[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at))
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    return acc


def as_slices(w: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One stack or a sequence of per-slice stacks, as a tuple of slices."""
    return (w,) if isinstance(w, torch.Tensor) else tuple(w)


def rank_pad(rank: int) -> int:
    """The rank as the kernels tile it: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_pow2(rank))


def fit_tile(tile: int, extent: int) -> int:
    """A configured tile along an axis of ``extent`` elements: at most the extent rounded up to a
    power of two, at least 16 (``tl.dot``'s minimum)."""
    return min(tile, max(16, next_pow2(extent)))


@functools.lru_cache(maxsize=None)
def split_k_plan(in_features: int, block_k: int, split_k: int) -> tuple[int, int, int, bool]:
    """``(block_k, split_k, k_per_split, even_k)`` of a shrink over ``in_features`` for the
    configured tile and split count: whole K tiles per split, no empty split, EVEN_K when no
    mask is needed."""
    block_k = fit_tile(block_k, in_features)
    n_k_blocks = cdiv(in_features, block_k)
    split_k = max(1, min(split_k, n_k_blocks))
    k_per_split = cdiv(n_k_blocks, split_k) * block_k
    split_k = cdiv(in_features, k_per_split)
    even_k = in_features % block_k == 0 and k_per_split * split_k == in_features
    return block_k, split_k, k_per_split, even_k


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can use programmatic dependent launch (sm90+)."""
    return t.is_cuda and _sm_major(t.device.index if t.device.index is not None
                                   else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
