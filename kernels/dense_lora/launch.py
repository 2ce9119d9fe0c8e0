"""Host side of the dense LoRA ops (kernels in ``kernels.dense_lora.kernels``, layouts there):
tile configs per token-count bucket (``dense_config``), ``dense_lora_shrink`` /
``dense_lora_expand`` and their ``*_with_plan`` forms, whose repeat calls of a known shape and
token-count bucket launch a prepared launch (``kernels.launch.cached``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.dense_lora.groups import TokenGroups
from kernels.dense_lora.kernels import (
    _dense_lora_expand_kernel,
    _dense_lora_fused_kernel,
    _dense_lora_shrink_kernel,
)
from kernels.launch.cached import (
    CachedLauncher,
    LaunchPlans,
    PreparedLaunch,
    aligned16,
    cdiv,
    next_pow2,
    raw_stream,
)
from kernels.lora_tiles import fit_tile, rank_pad, reads_slot_ranks, split_k_plan

MAX_SLICES = 3


@dataclass(frozen=True)
class DenseLoRAConfig:
    """Tiles of one dense LoRA layer call; ``fused``: shrink and expand in one launch
    (``dense_lora_fused``: ``split_k`` unused, ``block_k`` the shrink's K step)."""

    block_m: int
    block_k: int
    split_k: int
    block_n: int
    num_warps: int = 4
    fused: bool = False


FUSED_BLOCK_N = 512  # the fused form's output tile: each program re-reads its slot's A


def fused_form(cfg: DenseLoRAConfig) -> DenseLoRAConfig:
    """``cfg`` as one launch: ``fused``, ``FUSED_BLOCK_N`` columns per program (fewer programs
    re-reading A), 8 warps for that tile."""
    return DenseLoRAConfig(block_m=cfg.block_m, block_k=cfg.block_k, split_k=1,
                           block_n=max(cfg.block_n, FUSED_BLOCK_N), num_warps=8, fused=True)


# one M per bucket of ``dense_config`` (the warm-up compiles each bucket's variants with these)
DENSE_CONFIG_BUCKET_MS = (1, 65, 513, 4097)


@functools.lru_cache(maxsize=None)
def dense_config(m: int, in_features: int, num_slices: int = 1) -> DenseLoRAConfig:
    """Heuristic tiles for ``m`` tokens: small row blocks and split-K while few blocks are live
    (decode: each slot's A is streamed once, split over enough programs to fill the GPU); large
    row blocks and little split-K for prefill. One slice (o, down, router) splits K more, as it
    has a third of the programs of q/k/v. Depends on the M bucket only (warm-up covers it)."""
    one = num_slices == 1
    if m <= 64:
        return DenseLoRAConfig(block_m=16, block_k=64, split_k=16 if one else 8, block_n=128)
    if m <= 512:
        return DenseLoRAConfig(block_m=32, block_k=64, split_k=8 if one else 4, block_n=128)
    if m <= 4096:
        return DenseLoRAConfig(block_m=64, block_k=64, split_k=4 if one else 2, block_n=128,
                               num_warps=8)
    return DenseLoRAConfig(block_m=64, block_k=64, split_k=2 if one else 1, block_n=128,
                           num_warps=8)


_SHRINK_PLANS = LaunchPlans(CachedLauncher(_dense_lora_shrink_kernel))
_EXPAND_PLANS = LaunchPlans(CachedLauncher(_dense_lora_expand_kernel))
_FUSED_PLANS = LaunchPlans(CachedLauncher(_dense_lora_fused_kernel))
# arguments given anew per launch: x or y, 3 weight slices, part, 4 groups, live, the group
# count and the token count (``do_not_specialize``: a prepared launch serves every count of its
# ``plan_tokens`` bucket)
_LEAD = 12
PLAN_TOKENS_EXACT = 512  # token counts up to this keep their own launches (CUDA-graph sizes)
PLAN_TOKEN_GRAIN = 128


def plan_tokens(m: int) -> int:
    """The token count a launch is prepared for: ``m`` up to ``PLAN_TOKENS_EXACT``, above it
    ``m`` rounded up to ``PLAN_TOKEN_GRAIN`` (grid and partials sized for it; programs past the
    real row blocks exit at once). Eager steps of a server, whose counts differ by a few
    decode tokens from step to step, then reuse one prepared launch pair."""
    return m if m <= PLAN_TOKENS_EXACT else -(-m // PLAN_TOKEN_GRAIN) * PLAN_TOKEN_GRAIN


def row_blocks(m: int, block_m: int, num_groups: int) -> int:
    """Programs of the row axis: enough blocks of ``block_m`` rows for any split of ``m``
    tokens over ``num_groups`` groups (each group's last block may be partial)."""
    return cdiv(m, block_m) + num_groups - 1


def as_3d(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-slice stacks ``[L, 1, X, Y]`` as ``[L, X, Y]`` views (3-D ones as they are)."""
    return [t if t.dim() == 3 else t.flatten(1, 2) for t in stacks]


def dense_lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], groups: TokenGroups,
                      cfg: DenseLoRAConfig, scale: float = 1.0, use_pdl: bool = False,
                      slot_live: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, >=in]`` with ``A [L, 1, r, in]`` (or ``[L, r, in]``) per slice, all slices of one
    shape → fp32 partials ``[split_k, M, S*RP]`` at the tokens' sorted positions (RP = rank
    padded to 2^n >= 16). ``slot_live [L]`` int32 (optional): each slot's adapter rank for this
    layer, A rows past it are not read and slots at 0 are skipped (their partials are not
    written; pass the same tensor to the expand). Repeat calls of a
    known shape and M launch a prepared launch."""
    return shrink_with_plan(x, lora_a, groups, cfg, scale, use_pdl, slot_live)[0]


def shrink_with_plan(x, lora_a, groups, cfg, scale, use_pdl, slot_live
            ) -> tuple[torch.Tensor, PreparedLaunch | None]:
    """``dense_lora_shrink`` and the prepared launch it used (None: nothing launched)."""
    num_slices = len(lora_a)
    assert 1 <= num_slices <= MAX_SLICES
    a = as_3d(lora_a)
    a1 = a[min(1, num_slices - 1)]
    g, m = groups, groups.num_tokens
    mp = plan_tokens(m)
    live = g.slot if slot_live is None else slot_live
    key = (cfg, mp, x.stride(0), x.dtype, a[0].shape, a[0].stride(), num_slices, scale, use_pdl,
           g.slot.shape[0], slot_live is not None,
           aligned16(x, a[0], a1, a[-1], g.sorted_idx, g.slot, g.ntok, g.start, live))
    plan = _SHRINK_PLANS.get(key)
    if plan is not None:
        part = torch.empty(plan.extra, dtype=torch.float32, device=x.device)
        plan.launch(raw_stream(x.device), x, a[0], a1, a[-1], part, g.sorted_idx, g.slot, g.ntok,
                    g.start, live, g.num_groups, m)
        return part, plan
    rank, in_features = a[0].shape[-2], a[0].shape[-1]
    rp = rank_pad(rank)
    ranked = reads_slot_ranks(slot_live is not None, rank)
    block_k, split_k, k_per_split, even_k = split_k_plan(in_features, cfg.block_k, cfg.split_k)
    part = torch.empty((split_k, mp, num_slices * rp), dtype=torch.float32, device=x.device)
    if m == 0:
        return part, None
    assert x.stride(-1) == 1 and all(t.stride(-1) == 1 for t in a)
    assert all(t.shape == a[0].shape and t.stride() == a[0].stride() for t in a), \
        "slices must share shape and strides"
    plan = _SHRINK_PLANS.launch_new(
        key, (row_blocks(mp, cfg.block_m, g.num_groups), split_k, num_slices),
        (x, a[0], a1, a[-1], part, g.sorted_idx, g.slot, g.ntok, g.start, live, g.num_groups, m,
         in_features, rank, k_per_split, float(scale),
         x.stride(0), a[0].stride(0), a[0].stride(1), part.stride(0), part.stride(1)),
        dict(BM=cfg.block_m, RP=rp, BLOCK_K=block_k, EVEN_K=even_k,
             EVEN_R=rank == rp and not ranked, NUM_SLICES=num_slices, HAS_SCALE=scale != 1.0,
             G_P2=next_pow2(g.num_groups), HAS_LIVE=slot_live is not None, USE_PDL=use_pdl,
             LIVE_RANKS=ranked,
             num_warps=cfg.num_warps, num_stages=2, launch_pdl=use_pdl),
        lead=_LEAD, extra=tuple(part.shape))
    return part, plan


def dense_lora_expand(y: torch.Tensor, part: torch.Tensor, lora_b: Sequence[torch.Tensor],
                      groups: TokenGroups, cfg: DenseLoRAConfig, add_inputs: bool = True,
                      use_pdl: bool = False, slot_live: torch.Tensor | None = None) -> None:
    """``y [M, >=sum(N)] (+)= part @ B^T`` per slice, slice i into its columns; ``B [L, 1,
    N_i, r]`` (or ``[L, N_i, r]``). ``slot_live``: as for the shrink (B columns past a slot's
    rank are not read). Rows without an adapter, and with ``slot_live`` rows of slots whose
    entry is 0, are left untouched (so with ``add_inputs=False`` only pass
    ``slot_live`` when those rows may keep their contents). Repeat calls of a known shape and
    M launch a prepared launch."""
    expand_with_plan(y, part, lora_b, groups, cfg, add_inputs, use_pdl, slot_live)


def expand_with_plan(y, part, lora_b, groups, cfg, add_inputs, use_pdl, slot_live
            ) -> PreparedLaunch | None:
    """``dense_lora_expand`` returning the prepared launch it used (None: nothing launched)."""
    num_slices = len(lora_b)
    assert 1 <= num_slices <= MAX_SLICES
    b = as_3d(lora_b)
    b1 = b[min(1, num_slices - 1)]
    g, m = groups, groups.num_tokens
    if m == 0:
        return None
    mp = plan_tokens(m)
    assert part.shape[1] >= mp, (part.shape, mp)  # the shrink's partials, sized for mp
    live = g.slot if slot_live is None else slot_live
    key = (cfg, mp, y.stride(0), y.dtype, tuple(t.shape for t in b), tuple(t.stride() for t in b),
           add_inputs, use_pdl, part.shape, g.slot.shape[0], slot_live is not None,
           aligned16(y, b[0], b1, b[-1], part, g.sorted_idx, g.slot, g.ntok, g.start, live))
    plan = _EXPAND_PLANS.get(key)
    if plan is not None:
        plan.launch(raw_stream(y.device), y, b[0], b1, b[-1], part, g.sorted_idx, g.slot, g.ntok,
                    g.start, live, g.num_groups, m)
        return plan
    ns = [t.shape[-2] for t in b] + [0] * (MAX_SLICES - num_slices)
    rank = b[0].shape[-1]
    rp = rank_pad(rank)
    ranked = reads_slot_ranks(slot_live is not None, rank)
    assert y.stride(-1) == 1 and all(t.stride(-1) == 1 for t in b)
    assert all(t.stride(-2) == b[0].stride(-2) for t in b), "slices must share row strides"
    bl = [t.stride(0) for t in b] + [0] * (MAX_SLICES - num_slices)
    assert y.shape[-1] >= sum(ns), (y.shape, ns)
    block_n = fit_tile(cfg.block_n, max(ns))
    return _EXPAND_PLANS.launch_new(
        key, (cdiv(max(ns), block_n), row_blocks(mp, cfg.block_m, g.num_groups), num_slices),
        (y, b[0], b1, b[-1], part, g.sorted_idx, g.slot, g.ntok, g.start, live, g.num_groups, m,
         ns[0], ns[1], ns[2], rank, part.shape[0],
         y.stride(0), bl[0], bl[1], bl[2], b[0].stride(1), part.stride(0), part.stride(1)),
        dict(BM=cfg.block_m, RP=rp, BLOCK_N=block_n,
             EVEN_N=all(n % block_n == 0 for n in ns[:num_slices]),
             EVEN_R=rank == rp and not ranked,
             NUM_SLICES=num_slices, ADD_INPUTS=add_inputs, G_P2=next_pow2(g.num_groups),
             HAS_LIVE=slot_live is not None, USE_PDL=use_pdl, LIVE_RANKS=ranked,
             num_warps=cfg.num_warps, num_stages=1, launch_pdl=use_pdl),
        lead=_LEAD)


def dense_lora_fused(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                     lora_b: Sequence[torch.Tensor], groups: TokenGroups, cfg: DenseLoRAConfig,
                     scale: float = 1.0, add_inputs: bool = True,
                     slot_live: torch.Tensor | None = None) -> None:
    """``dense_lora_shrink`` + ``dense_lora_expand`` in one launch (shapes and ``slot_live`` as
    there): ``y [M, >=sum(N)] (+)= scale * x A_i^T B_i^T`` per slice. Repeat calls of a known
    shape and M launch a prepared launch."""
    fused_with_plan(y, x, lora_a, lora_b, groups, cfg, scale, add_inputs, slot_live)


# arguments given anew per fused launch: y, x, 3 A slices, 3 B slices, 4 groups, live, the group
# count and the token count
_FUSED_LEAD = 15


def fused_with_plan(y, x, lora_a, lora_b, groups, cfg, scale, add_inputs, slot_live
                    ) -> PreparedLaunch | None:
    """``dense_lora_fused`` returning the prepared launch it used (None: nothing launched)."""
    num_slices = len(lora_a)
    assert 1 <= num_slices <= MAX_SLICES and len(lora_b) == num_slices
    a, b = as_3d(lora_a), as_3d(lora_b)
    a1, b1 = a[min(1, num_slices - 1)], b[min(1, num_slices - 1)]
    g, m = groups, groups.num_tokens
    if m == 0:
        return None
    mp = plan_tokens(m)
    live = g.slot if slot_live is None else slot_live
    key = (cfg, mp, x.stride(0), y.stride(0), x.dtype, y.dtype, a[0].shape, a[0].stride(),
           tuple(t.shape for t in b), tuple(t.stride() for t in b), num_slices, scale,
           add_inputs, g.slot.shape[0], slot_live is not None,
           aligned16(y, x, a[0], a1, a[-1], b[0], b1, b[-1], g.sorted_idx, g.slot, g.ntok,
                     g.start, live))
    tensors = (y, x, a[0], a1, a[-1], b[0], b1, b[-1], g.sorted_idx, g.slot, g.ntok, g.start,
               live, g.num_groups, m)
    plan = _FUSED_PLANS.get(key)
    if plan is not None:
        plan.launch(raw_stream(y.device), *tensors)
        return plan
    rank, in_features = a[0].shape[-2], a[0].shape[-1]
    rp = rank_pad(rank)
    ranked = reads_slot_ranks(slot_live is not None, rank)
    ns = [t.shape[-2] for t in b] + [0] * (MAX_SLICES - num_slices)
    assert x.stride(-1) == 1 and y.stride(-1) == 1
    assert all(t.stride(-1) == 1 for t in (*a, *b))
    assert all(t.shape == a[0].shape and t.stride() == a[0].stride() for t in a), \
        "A slices must share shape and strides"
    assert all(t.stride(-2) == b[0].stride(-2) for t in b), "B slices must share row strides"
    assert y.shape[-1] >= sum(ns), (y.shape, ns)
    block_k = fit_tile(cfg.block_k, in_features)
    block_n = fit_tile(cfg.block_n, max(ns))
    bl = [t.stride(0) for t in b] + [0] * (MAX_SLICES - num_slices)
    return _FUSED_PLANS.launch_new(
        key, (cdiv(max(ns), block_n), row_blocks(mp, cfg.block_m, g.num_groups), num_slices),
        (*tensors, in_features, ns[0], ns[1], ns[2], rank, float(scale),
         x.stride(0), a[0].stride(0), a[0].stride(1), y.stride(0), bl[0], bl[1], bl[2],
         b[0].stride(1)),
        dict(BM=cfg.block_m, RP=rp, BLOCK_K=block_k, BLOCK_N=block_n,
             EVEN_K=in_features % block_k == 0,
             EVEN_N=all(n % block_n == 0 for n in ns[:num_slices]),
             EVEN_R=rank == rp and not ranked, NUM_SLICES=num_slices, HAS_SCALE=scale != 1.0,
             ADD_INPUTS=add_inputs, G_P2=next_pow2(g.num_groups),
             HAS_LIVE=slot_live is not None, LIVE_RANKS=ranked,
             num_warps=cfg.num_warps, num_stages=2),
        lead=_FUSED_LEAD)
