"""Routing data for triton_kernels' ``matmul_ogs`` from the router's top-k, inputs in one launch.

With LoRA on, vLLM 0.24's MXFP4 experts get the router's ``topk_ids`` / ``topk_weights`` and
rebuild ``matmul_ogs``' routing data from them (``make_routing_data``): the ids to int16, the
weights to bf16, a zeroed bit matrix, the bit packing, ``ids == -1``, a ``where`` for the
weights of padding ids, and a zeroed histogram scratchpad — seven launches per MoE layer before
the sort, ~9 µs per layer at decode, more than the sort itself. ``routing_inputs`` writes all of
those tensors in one launch; ``routing_data`` hands them to triton_kernels' own sort kernels
(``kernels.mxfp4.sort``), so the routing data is the same as vLLM's, field for field.

Shapes: ``topk_ids [M, K]`` (int32 or int64, -1 = no expert), ``topk_weights [M, K]`` float;
``E`` experts. Bit matrix ``[M, ceil(E / 32)]`` uint32: bit ``e % 32`` of word ``e // 32`` set
for each id ``e`` of the row. Ids of one row are distinct (top-k), so a word is the sum of its
bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch.cached import CachedLauncher, cdiv, next_pow2

ROWS_PER_PROGRAM = 128
_KEPT_SORT = os.environ.get("LORAPLEX_KEPT_SORT", "1") != "0"


@triton.jit
def _bf16_bits(x):
    """The bf16 bit patterns (int16) of finite float32 ``x``, rounded to nearest even, as
    ``Tensor.to(torch.bfloat16)`` rounds (integer arithmetic: the same on a GPU and in the
    interpreter)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit(do_not_specialize=["n_rows"])
def _routing_inputs_kernel(ids_ptr, weights_ptr, ids16_ptr, scal_ptr, bits_ptr, sums_ptr,
                           n_rows, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                           BIT_WORDS: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program per ``BLOCK_M`` rows: int16 ids, bf16 weights (-1 where the id is -1; stored
    as int16 bit patterns), the rows' bit-matrix words; program 0 also zeroes the
    ``BIT_WORDS * 32`` histogram sums."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (ks < TOP_K)[None, :]
    offs = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    weights = tl.load(weights_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ids16_ptr + offs, ids.to(tl.int16), mask=mask)
    tl.store(scal_ptr + offs, _bf16_bits(tl.where(ids == -1, -1.0, weights)), mask=mask)
    valid = ids >= 0
    shift = tl.where(valid, ids % 32, 0).to(tl.int64)  # no negative shifts for padding ids
    bit = tl.full(ids.shape, 1, tl.int64) << shift
    for word in tl.static_range(BIT_WORDS):
        in_word = valid & (ids // 32 == word)
        packed = tl.sum(tl.where(in_word, bit, 0), axis=1)  # distinct ids: the sum is the OR
        tl.store(bits_ptr + rows.to(tl.int64) * BIT_WORDS + word, packed.to(tl.int32),
                 mask=row_ok)
    if pid == 0:
        for word in tl.static_range(BIT_WORDS):
            tl.store(sums_ptr + word * 32 + tl.arange(0, 32), tl.zeros([32], dtype=tl.int32))


_ROUTING_INPUTS = CachedLauncher(_routing_inputs_kernel)  # one launch per MoE layer and step


def routing_inputs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """``(ids int16 [M, K], weights bf16 [M, K], bit matrix uint32 [M, ceil(E/32)], zeroed sums
    int32 [32 * ceil(E/32)])`` of the top-k, as ``make_routing_data`` prepares them."""
    n_rows, top_k = topk_ids.shape
    words = cdiv(num_experts, 32)
    dev = topk_ids.device
    ids16 = torch.empty((n_rows, top_k), dtype=torch.int16, device=dev)
    scal = torch.empty((n_rows, top_k), dtype=torch.bfloat16, device=dev)
    bits = torch.empty((n_rows, words), dtype=torch.int32, device=dev)
    sums = torch.empty(words * 32, dtype=torch.int32, device=dev)
    _ROUTING_INPUTS((max(1, cdiv(n_rows, ROWS_PER_PROGRAM)),), topk_ids.contiguous(),
                    topk_weights.contiguous(), ids16, scal.view(torch.int16), bits, sums, n_rows,
                    num_warps=4, TOP_K=top_k, BLOCK_K=next_pow2(top_k), BIT_WORDS=words,
                    BLOCK_M=ROWS_PER_PROGRAM)
    return ids16, scal, bits.view(torch.uint32), sums


def routing_data(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """``(RoutingData, GatherIndx, ScatterIndx)`` of the top-k for ``matmul_ogs``, as vLLM
    0.24's ``make_routing_data`` builds them with triton_kernels' v3.5 API: the sort is
    triton_kernels' own kernels (``kernels.mxfp4.sort``: launched without the generic path;
    ``LORAPLEX_KEPT_SORT=0``: through ``routing_from_bitmatrix``)."""
    n_rows, top_k = topk_ids.shape
    ids16, scal, bits, sums = routing_inputs(topk_ids, topk_weights, num_experts)
    if _KEPT_SORT:
        from kernels.mxfp4.sort import sort_routing

        return sort_routing(ids16, scal, bits, sums, num_experts)
    from triton_kernels.routing import routing_from_bitmatrix
    from triton_kernels.tensor import Bitmatrix

    bitmatrix = Bitmatrix(bits, shape=[n_rows, bits.shape[1] * 32], shape_max=[n_rows, None],
                          scratchpad=sums)
    return routing_from_bitmatrix(bitmatrix, scal, ids16, num_experts, top_k)
