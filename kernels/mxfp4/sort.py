"""The expert sort of ``matmul_ogs``' routing data, with triton_kernels' own kernels launched
through ``CachedLauncher`` (vLLM 0.24's bundled triton_kernels, v3.5 API).

triton_kernels' ``routing_from_bitmatrix`` sorts the (token, expert) pairs by expert with three
kernels — the bit matrix's column sums with per-32-row partial sums, a combined memset /
prefix-sum pass, a combined index / tile-map pass — behind an autograd function, a bit-matrix
wrapper, seven allocations and Triton's generic launch path: host work on every MoE layer of a
prefill step, which runs outside CUDA graphs. ``sort_routing`` launches the same three kernels
with the same arguments, its int32 buffers carved from one allocation, and returns the same
``(RoutingData, GatherIndx, ScatterIndx)``.

Shapes: ``ids16 [M, K]`` int16 (-1 = no expert), ``scal [M, K]`` bf16, ``bits [M, W]`` uint32
(W = ceil(E / 32)), ``sums [32 W]`` int32 zeroed (``kernels.mxfp4.routing.routing_inputs``).
Outputs, for ``G = M K`` pairs: ``hist [E]``, ``gather.src_indx [G]`` (pair of each sorted
row), ``gather.dst_indx [G]`` (sorted row of each pair), ``gate_scal [G]`` (sorted weights),
``token_offs_raw [E + 1]``, ``token_offs_pad`` / ``block_pid_map`` per tile height 16–128.
"""

from __future__ import annotations

import torch

from kernels.launch.cached import CachedLauncher, cdiv

HIST_ROWS = 32  # rows per partial histogram
HIST_TILE = 4  # partial histograms per program of the column-sum kernel
TILE_LOG2_START, TILE_SIZES = 4, 4  # tile heights 16, 32, 64, 128
OFFS_PAD, INDX_MEMSET_BLOCK, TILE_BLOCK = 512, 1024, 512
_ALIGN = 32  # int32 elements: every buffer starts on a 128-byte boundary
_LAUNCHERS: dict[str, CachedLauncher] = {}


def _launchers() -> dict[str, CachedLauncher]:
    if not _LAUNCHERS:
        from triton_kernels.reduction_details.reduce_bitmatrix import (
            _sum_bitmatrix_rows,
        )
        from triton_kernels.routing_details._routing_compute import (
            _combined_routing_compute,
            _combined_routing_memset,
        )

        _LAUNCHERS.update(sums=CachedLauncher(_sum_bitmatrix_rows),
                          memset=CachedLauncher(_combined_routing_memset),
                          compute=CachedLauncher(_combined_routing_compute))
    return _LAUNCHERS


def max_tiles(pairs: int, experts: int) -> int:
    """Upper bound on the tiles of the smallest height (16) over all experts."""
    if pairs <= experts:
        return pairs
    return experts - 1 - ((experts - pairs - 1) // 2 ** TILE_LOG2_START)


def _carve(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive 1-D slices of ``buf`` of ``sizes`` elements, each start aligned."""
    out, at = [], 0
    for size in sizes:
        out.append(buf[at:at + size])
        at += cdiv(size, _ALIGN) * _ALIGN
    return out


def _buffer_elements(sizes: list[int]) -> int:
    return sum(cdiv(size, _ALIGN) * _ALIGN for size in sizes)


def sort_routing(ids16: torch.Tensor, scal: torch.Tensor, bits: torch.Tensor,
                 sums: torch.Tensor, num_experts: int):
    """``(RoutingData, GatherIndx, ScatterIndx)`` as ``routing_from_bitmatrix`` returns them
    for these inputs (module docstring)."""
    from triton_kernels.routing import ExptData, GatherIndx, RoutingData, ScatterIndx

    k = _launchers()
    n_rows, top_k = ids16.shape
    words, e = bits.shape[1], num_experts
    pairs = n_rows * top_k
    part_cols = cdiv(n_rows, HIST_ROWS * HIST_TILE) * HIST_TILE
    tiles = max_tiles(pairs, e)
    pad_e, pad_t = cdiv(e + 1, OFFS_PAD) * OFFS_PAD, cdiv(tiles, OFFS_PAD) * OFFS_PAD
    sizes = [words * 32 * part_cols, e, 2 * pairs, (TILE_SIZES + 1) * pad_e, TILE_SIZES * pad_t,
             cdiv(pairs * scal.element_size(), 4)]
    buf = torch.empty(_buffer_elements(sizes), dtype=torch.int32, device=ids16.device)
    part, expt_offs, indx, offs, pid_map, scal_words = _carve(buf, sizes)
    partials = part.view(words * 32, part_cols).t()  # [part_cols, 32 W], column-major
    offs, pid_map = offs.view(TILE_SIZES + 1, pad_e), pid_map.view(TILE_SIZES, pad_t)
    topk_indx, gate_indx = indx[:pairs], indx[pairs:]
    gate_scal = scal_words.view(scal.dtype)[:pairs]

    k["sums"]((part_cols // HIST_TILE, words), bits, n_rows, bits.stride(0), bits.stride(1),
              sums, partials, partials.stride(0), partials.stride(1), partials.shape[1],
              num_warps=8, BLOCK_MM=HIST_ROWS * HIST_TILE, BLOCK_M=HIST_ROWS)
    partials = partials[:cdiv(n_rows, HIST_ROWS)]
    hist = sums[:e]
    token_offs_pad, block_pid_map = offs[1:, :e + 1], pid_map[:, :tiles]
    tile_blocks = pid_map.numel() // OFFS_PAD + TILE_SIZES + 1
    indx_blocks = cdiv(2 * pairs, INDX_MEMSET_BLOCK) + e + 1
    k["memset"]((tile_blocks + indx_blocks,), indx, 2 * pairs, -1, INDX_MEMSET_BLOCK, hist,
                expt_offs, e, e, partials, partials.shape[0], partials.stride(0),
                partials.stride(1), offs, offs.stride(0), tile_blocks, block_pid_map,
                TILE_LOG2_START, num_warps=4, SIZES=TILE_SIZES, BLOCK_A=OFFS_PAD, BLOCK_N=512,
                BLOCK_M=512)
    data_blocks = e * TILE_SIZES
    k["compute"]((data_blocks + cdiv(n_rows, HIST_ROWS),), topk_indx, gate_indx, gate_scal,
                 scal, ids16, partials, partials.stride(0), partials.stride(1), expt_offs,
                 n_rows, HIST_ROWS, top_k, hist, token_offs_pad, token_offs_pad.stride(0),
                 block_pid_map, block_pid_map.stride(0), TILE_LOG2_START, TILE_SIZES,
                 TILE_BLOCK, data_blocks, num_warps=4)
    heights = [2 ** (TILE_LOG2_START + i) for i in range(TILE_SIZES)]
    expt_data = ExptData(hist, offs[0, :e + 1],
                         {h: token_offs_pad[i] for i, h in enumerate(heights)},
                         {h: block_pid_map[i] for i, h in enumerate(heights)})
    routing = RoutingData(gate_scal, hist, e, top_k, expt_data)
    return (routing, GatherIndx(src_indx=topk_indx, dst_indx=gate_indx),
            ScatterIndx(src_indx=gate_indx, dst_indx=topk_indx))
