"""GPT-OSS's swiglu activation folded into the gate_up LoRA expand, and its complement.

Under LoRA the MXFP4 experts write the w13 GEMM's output ``y13 [M*K, 2I]`` (gate and up columns
interleaved), the gate_up expand adds the LoRA delta to it in place, and a separate kernel turns
it into the activation ``act [M*K, I]``: the whole ``[M*K, 2I]`` tensor is written and read once
more than needed (0.75 GB per layer at 8192 tokens). With ``act`` given, the expand
(``kernels.moe_lora.kernels``, ``SWIGLU``) computes the activation of the rows it owns (those
with expert LoRA) from its fp32 sum and writes ``act`` instead of ``y13``;
``swiglu_rows_without_lora`` does the other rows, reading ``y13`` as the GEMM left it. With a
row map (``kernels.moe_lora.kernels``), row ``t*K+k`` of ``y13`` and ``act`` is
``row_map[t*K+k]`` (the MXFP4 experts' expert-sorted rows).

Activation (vLLM's ``swigluoai_and_mul``): ``gate = min(y[2j], limit)``, ``up = clamp(y[2j+1],
-limit, limit)``, ``act[j] = gate * sigmoid(alpha * gate) * (up + 1)``, in fp32 from the bf16
values vLLM's path would hold (the expand rounds its sum to ``y13``'s dtype first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch.cached import (
    CachedLauncher,
    LaunchPlans,
    aligned16,
    cdiv,
    next_pow2,
    raw_stream,
)
from kernels.lora_tiles import row_map_arg
from kernels.moe_lora.align import _row_keys
from kernels.moe_math import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

BLOCK_ROWS, BLOCK_COLS = 16, 128


@triton.jit
def swiglu_oai(gate, up, alpha, limit):
    """GPT-OSS's activation of fp32 ``gate`` / ``up`` tiles (vLLM's ``swigluoai_and_mul``)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate * alpha) * (up + 1.0)


@triton.jit(do_not_specialize=["num_rows"])
def _swiglu_rows_without_lora_kernel(
    act_ptr, y_ptr, topk_ids_ptr, token_lora_ptr, enabled_ptr, row_map_ptr, num_rows, top_k,
    num_experts, half_n, stride_am, stride_ym, alpha, limit, BM: tl.constexpr,
    BN: tl.constexpr, ROW_MAP: tl.constexpr,
):
    """Program ``(row block, column block)``: ``act`` of the rows without expert LoRA (the
    align kernel's own test, ``_row_keys``); a block whose rows all have it exits at once.
    ``ROW_MAP``: rows at ``row_map[row]`` (negative: a padding pair, no row)."""
    pairs = tl.program_id(0) * BM + tl.arange(0, BM)
    _, has_lora = _row_keys(topk_ids_ptr, token_lora_ptr, enabled_ptr, pairs, num_rows, top_k,
                            num_experts, 0)
    todo = (pairs < num_rows) & (has_lora == 0)
    rows = pairs
    if ROW_MAP:
        rows = tl.load(row_map_ptr + pairs, mask=todo, other=0)
        todo = todo & (rows >= 0)
    if tl.max(todo.to(tl.int32), 0) == 0:
        return
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = todo[:, None] & (cols < half_n)[None, :]
    y_row = y_ptr + rows.to(tl.int64)[:, None] * stride_ym
    gate = tl.load(y_row + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_row + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    out = swiglu_oai(gate, up, alpha, limit)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :],
             out.to(act_ptr.dtype.element_ty), mask=mask)


_COMPLEMENT = CachedLauncher(_swiglu_rows_without_lora_kernel)
_COMPLEMENT_PLANS = LaunchPlans(_COMPLEMENT, 256)  # kept launches by grid bucket, fixed args
_LEAD = 7  # act, y13, topk_ids, token_lora, enabled, row map, num_rows: given per launch
GRID_GRAIN = 64  # row blocks: token counts within one grain share a kept launch


def complement_grid_rows(num_rows: int) -> int:
    """Row blocks of the complement's grid for ``num_rows`` pairs: a power of two up to
    ``GRID_GRAIN``, a multiple of it beyond (programs past ``num_rows`` exit at once)."""
    blocks = max(1, cdiv(num_rows, BLOCK_ROWS))
    return next_pow2(blocks) if blocks <= GRID_GRAIN else cdiv(blocks, GRID_GRAIN) * GRID_GRAIN


def swiglu_rows_without_lora(act: torch.Tensor, y13: torch.Tensor, topk_ids: torch.Tensor,
                             token_lora: torch.Tensor, enabled: torch.Tensor, num_experts: int,
                             alpha: float = SWIGLUOAI_ALPHA,
                             limit: float = SWIGLUOAI_LIMIT,
                             row_map: torch.Tensor | None = None) -> None:
    """``act [M*K, I]`` of the rows without expert LoRA from ``y13 [M*K, 2I]`` (``topk_ids
    [M, K]`` int32, ``token_lora [>=M]`` slot or -1, ``enabled [L]``): what the fused expand
    leaves to do. ``row_map [M*K]`` int32: pair ``t*K+k``'s rows of ``y13`` and ``act`` are
    ``row_map[t*K+k]``. Grid depends only on M (CUDA-graph safe); token counts within one
    grid bucket (``complement_grid_rows``) share a kept launch."""
    rows, top_k = topk_ids.numel(), topk_ids.shape[1]
    half_n = act.shape[1]
    assert y13.shape[1] == 2 * half_n and act.stride(1) == 1 and y13.stride(1) == 1
    rm = row_map_arg(row_map, topk_ids, rows)
    lead = (act, y13, topk_ids, token_lora, enabled, rm, rows)
    grid = (complement_grid_rows(rows), cdiv(half_n, BLOCK_COLS))
    fixed = (top_k, num_experts, half_n, act.stride(0), y13.stride(0), float(alpha),
             float(limit))
    key = None
    if aligned16(act, y13, topk_ids, token_lora, enabled, rm) and rows < 2**31:
        key = (grid, fixed, tuple(t.dtype for t in lead[:6]), row_map is not None, act.device)
        plan = _COMPLEMENT_PLANS.get(key)
        if plan is not None:
            plan.launch(raw_stream(act.device), *lead)
            return
    kwargs = dict(num_warps=4, BM=BLOCK_ROWS, BN=BLOCK_COLS, ROW_MAP=row_map is not None)
    if key is None:  # a tensor off the 16-byte grid: Triton's own specialisation, every call
        _COMPLEMENT(grid, *lead, *fixed, **kwargs)
    else:
        _COMPLEMENT_PLANS.launch_new(key, grid, lead + fixed, kwargs, _LEAD)
