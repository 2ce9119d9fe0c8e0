"""Sorts the (token, expert) rows of a MoE layer into (adapter, expert) blocks for the LoRA kernels.

One Triton program (a single CTA) does a counting sort on the device, so the whole step is one
launch whose grid does not depend on the data (CUDA-graph safe) and whose integer arguments that
vary with the batch are not specialised (no recompilation per sequence length). For large batches
the single program is the bottleneck (112 µs per layer at 8192 tokens on an H200), so a parallel
variant (``parallel=True``, chosen per batch-size bucket by the tuner) splits the rows into chunks:
one launch writes each chunk's pair histogram, a second lays out the blocks from their sums and
places each chunk's rows from the prefix of the chunks before it; its grid depends on M only.

Notation: M tokens, K experts per token (top-k), n = M*K rows (row ``t*K + k`` is token t's k-th
expert, the row order of vLLM's ``intermediate_cache`` tensors), L adapter slots, E experts,
P = L*E (adapter, expert) pairs, BM rows per block.

Output (``MoELoRABlocks``), for the kernels in ``kernels/moe_lora/kernels.py``:

- ``sorted_rows [max_blocks*BM]`` int32: block b owns ``sorted_rows[b*BM : b*BM + nrows[b]]``,
  the rows of one (adapter, expert) pair; entries past ``nrows[b]`` are not written.
- ``block_pair [max_blocks]``: ``adapter*E + expert`` of block b (valid for b < num_blocks).
- ``block_nrows [max_blocks]``: valid rows of block b, 1..BM.
- ``num_blocks [1]``: blocks in use; programs of the LoRA kernels with a larger block index exit
  at once, so a batch without MoE-LoRA tokens costs only the launches.

``naive=True`` skips the sort (no launch): block b is row b alone and the kernels read the row's
adapter and expert themselves. For tiny batches, where rows seldom share a pair, that saves the
align launch at the price of reading a pair's weights once per row.

Rows of tokens without an adapter (``token_lora == -1``), of slots whose ``enabled`` entry is 0
(an adapter without expert LoRA) and of experts < 0 (not local under expert parallelism) are in
no block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch.cached import (
    CachedLauncher,
    PlanTable,
    aligned16,
    cdiv,
    next_pow2,
    raw_stream,
)


@dataclass
class MoELoRABlocks:
    """Block layout of one batch; shapes in the module doc. Reused by the gate_up and down ops."""

    sorted_rows: torch.Tensor
    block_pair: torch.Tensor
    block_nrows: torch.Tensor
    num_blocks: torch.Tensor
    max_blocks: int
    block_m: int
    num_rows: int
    top_k: int
    num_experts: int
    naive: bool
    topk_ids: torch.Tensor  # [M, K] int32, read by the kernels in naive mode
    token_lora: torch.Tensor  # [>=M] int32
    enabled: torch.Tensor  # [L] int32
    align_plans: list | None = None  # the prepared align launch(es) used (sorted, M > 0)
    # ``enabled`` holds each slot's adapter rank (0: none), not a flag: the shrink / expand read
    # A rows and B columns only up to it (``kernels.lora_tiles.slot_rank``)
    slot_ranks: bool = False


def max_num_blocks(num_rows: int, num_pairs: int, block_m: int) -> int:
    """Upper bound of the blocks any routing of ``num_rows`` rows over ``num_pairs`` pairs needs."""
    if num_rows == 0:
        return 0
    return min(num_rows, cdiv(num_rows, block_m) + min(num_rows, num_pairs) - 1)


BLOCK_GRAIN = 64  # layouts round their block count up to this (``layout_blocks``)


def layout_blocks(num_rows: int, num_pairs: int, block_m: int) -> int:
    """The block count a layout is sized for: ``max_num_blocks`` rounded up to ``BLOCK_GRAIN``
    (programs past the batch's real block count exit at once). Batch sizes within one grain
    share the layout — buffers, grids, the ops' prepared launches — so the steps of a server,
    whose token counts differ from step to step, reuse what an earlier nearby size prepared."""
    blocks = max_num_blocks(num_rows, num_pairs, block_m)
    return _round_up(blocks, BLOCK_GRAIN) if blocks else 0


@functools.lru_cache(maxsize=4096)  # per layer and step: one lookup
def layout_key(num_rows: int, num_pairs: int, block_m: int, parallel: bool) -> tuple:
    """What a sorted layout and its align launches depend on besides the batch's tensors (and
    its row count, which the align programs take as an argument): the block count, the block
    size, and the sort's shape (the parallel sort's program count, or the single program's
    chunk size)."""
    sort = cdiv(num_rows, PARALLEL_CHUNK) if parallel else align_chunk(num_rows)
    return layout_blocks(num_rows, num_pairs, block_m), block_m, parallel, sort


ALIGN_CHUNKS = (256, 1024, 4096)
PARALLEL_CHUNK = 1024  # rows per program of the parallel align
_ALIGN_INTS = 4  # int32 elements per 16 bytes


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def align_chunk(num_rows: int) -> int:
    """Rows the align program takes per step: three sizes only, so batch sizes compile at most
    three variants of it (``warm_up`` in ``kernels.moe_lora.ops`` compiles them ahead)."""
    for c in ALIGN_CHUNKS[:-1]:
        if num_rows <= c:
            return c
    return ALIGN_CHUNKS[-1]


@triton.jit
def _row_keys(topk_ids_ptr, token_lora_ptr, enabled_ptr, rows, num_rows, top_k, num_experts,
              INVALID: tl.constexpr):
    """Pair key ``adapter*E + expert`` of each row, INVALID for rows without expert LoRA."""
    in_range = rows < num_rows
    expert = tl.load(topk_ids_ptr + rows, mask=in_range, other=-1)
    slot = tl.load(token_lora_ptr + rows // top_k, mask=in_range, other=-1)
    has_slot = in_range & (slot >= 0)
    enabled = tl.load(enabled_ptr + slot, mask=has_slot, other=0)
    valid = has_slot & (enabled != 0) & (expert >= 0)
    return tl.where(valid, slot * num_experts + expert, INVALID), valid


@triton.jit
def _block_table(counts, pairs, block_pair_ptr, block_nrows_ptr, num_blocks_ptr, WRITE,
                 BM: tl.constexpr):
    """Blocks of ``counts`` rows per pair: first block of each pair; the table when WRITE."""
    nblk = (counts + BM - 1) // BM
    blk_end = tl.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    if WRITE:
        tl.store(num_blocks_ptr, tl.sum(nblk, 0))
        most = tl.max(nblk, 0)
        for j in range(0, most):
            has = j < nblk
            tl.store(block_pair_ptr + blk_start + j, pairs, mask=has)
            tl.store(block_nrows_ptr + blk_start + j, tl.minimum(counts - j * BM, BM), mask=has)
    return blk_start


@triton.jit
def _place_rows(topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts,
                cursor_ptr, sorted_rows_ptr, start, stop, INVALID: tl.constexpr,
                CHUNK: tl.constexpr):
    """Rows ``[start, stop)``: each to the next free position of its pair (``cursor``)."""
    for s in range(start, stop, CHUNK):
        rows = s + tl.arange(0, CHUNK)
        key, valid = _row_keys(topk_ids_ptr, token_lora_ptr, enabled_ptr, rows, num_rows,
                               top_k, num_experts, INVALID)
        valid = valid & (rows < stop)
        pos = tl.atomic_add(cursor_ptr + key, 1, mask=valid, sem="relaxed")
        tl.store(sorted_rows_ptr + pos, rows, mask=valid)


@triton.jit(do_not_specialize=["num_rows"])
def _moe_lora_align_kernel(
    topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts,
    cursor_ptr, sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    PAIRS_P2: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr,
):
    """One program: count every row's pair, lay out the blocks, place every row."""
    pairs = tl.arange(0, PAIRS_P2)
    invalid: tl.constexpr = PAIRS_P2 - 1
    counts = tl.zeros([PAIRS_P2], dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        key, _ = _row_keys(topk_ids_ptr, token_lora_ptr, enabled_ptr, rows, num_rows, top_k,
                           num_experts, invalid)
        counts += tl.histogram(key, PAIRS_P2)
    counts = tl.where(pairs < invalid, counts, 0)
    blk_start = _block_table(counts, pairs, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
                             True, BM)
    tl.store(cursor_ptr + pairs, blk_start * BM)
    tl.debug_barrier()
    _place_rows(topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts,
                cursor_ptr, sorted_rows_ptr, 0, num_rows, invalid, CHUNK)


@triton.jit(do_not_specialize=["num_rows"])
def _moe_lora_count_kernel(
    topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts, hist_ptr,
    PAIRS_P2: tl.constexpr, CHUNK: tl.constexpr,
):
    """Parallel align, step 1: program c writes the pair histogram of rows
    ``[c*CHUNK, (c+1)*CHUNK)`` to ``hist[c]``."""
    c = tl.program_id(0)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    key, _ = _row_keys(topk_ids_ptr, token_lora_ptr, enabled_ptr, rows, num_rows, top_k,
                       num_experts, PAIRS_P2 - 1)
    tl.store(hist_ptr + c * PAIRS_P2 + tl.arange(0, PAIRS_P2), tl.histogram(key, PAIRS_P2))


@triton.jit(do_not_specialize=["num_rows", "num_chunks"])
def _moe_lora_place_kernel(
    topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts, hist_ptr,
    num_chunks, cursor_ptr, sorted_rows_ptr, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
    PAIRS_P2: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr,
):
    """Parallel align, step 2: program c sums all chunks' histograms (the totals lay out the
    blocks; program 0 writes the table) and those of chunks before c (where chunk c's rows of
    each pair start), then places its own rows with a cursor of its own."""
    c = tl.program_id(0)
    pairs = tl.arange(0, PAIRS_P2)
    invalid: tl.constexpr = PAIRS_P2 - 1
    counts = tl.zeros([PAIRS_P2], dtype=tl.int32)
    before = tl.zeros([PAIRS_P2], dtype=tl.int32)
    for j in range(0, num_chunks):
        h = tl.load(hist_ptr + j * PAIRS_P2 + pairs)
        counts += h
        before += tl.where(j < c, h, 0)
    counts = tl.where(pairs < invalid, counts, 0)
    blk_start = _block_table(counts, pairs, block_pair_ptr, block_nrows_ptr, num_blocks_ptr,
                             c == 0, BM)
    cursor = cursor_ptr + c * PAIRS_P2
    tl.store(cursor + pairs, blk_start * BM + before)
    tl.debug_barrier()
    _place_rows(topk_ids_ptr, token_lora_ptr, enabled_ptr, num_rows, top_k, num_experts,
                cursor, sorted_rows_ptr, c * CHUNK, tl.minimum(c * CHUNK + CHUNK, num_rows),
                invalid, CHUNK)


_ALIGN = CachedLauncher(_moe_lora_align_kernel)
_COUNT = CachedLauncher(_moe_lora_count_kernel)
_PLACE = CachedLauncher(_moe_lora_place_kernel)
_ALIGN_PLANS = PlanTable()  # key -> [PreparedLaunch] (one, or count + place)


@functools.cache
def _unused_table(device: torch.device) -> torch.Tensor:
    """The naive layout's stand-in for the block tables (its kernels never read them): one
    int32 per device, made once, not a fill launch per layer and step."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=4096)
def block_layout(num_rows: int, num_pairs: int, block_m: int, parallel: bool
            ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(max_blocks, starts, sizes)`` of the int32 buffer that holds the layout: cursor,
    num_blocks, block_pair, block_nrows, sorted_rows, histograms (parallel only), each part
    starting on a 16-byte boundary. Triton specialises pointer arguments on that alignment, so
    offsets that varied with max_blocks (i.e. with M) would compile new kernel variants.
    ``max_blocks`` is ``layout_blocks``' (the same for every M of one ``layout_key``)."""
    pairs_p2 = next_pow2(num_pairs + 1)
    max_blocks = layout_blocks(num_rows, num_pairs, block_m)
    num_chunks = cdiv(num_rows, PARALLEL_CHUNK) if parallel else 1
    sizes = (num_chunks * pairs_p2, 1, max_blocks, max_blocks, max_blocks * block_m,
             num_chunks * pairs_p2 if parallel else 0)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + _round_up(n, _ALIGN_INTS))
    return max_blocks, tuple(starts), sizes


def _prepare_align(inputs: tuple, parallel: bool, pairs_p2: int, block_m: int, cursor,
                   num_blocks, block_pair, block_nrows, sorted_rows, hist) -> list:
    """Launches the align program(s) for ``inputs`` (ids, token_lora, enabled, num_rows, top_k,
    num_experts) and returns the prepared launches (``PreparedLaunch``)."""
    num_rows = inputs[3]
    if parallel:
        num_chunks = cdiv(num_rows, PARALLEL_CHUNK)
        count = _COUNT.prepare((num_chunks,), *inputs, hist, PAIRS_P2=pairs_p2,
                               CHUNK=PARALLEL_CHUNK, num_warps=4)
        place = _PLACE.prepare((num_chunks,), *inputs, hist, num_chunks, cursor, sorted_rows,
                               block_pair, block_nrows, num_blocks, PAIRS_P2=pairs_p2,
                               CHUNK=PARALLEL_CHUNK, BM=block_m, num_warps=4)
        place.extra = num_chunks
        return [count, place]
    chunk = align_chunk(num_rows)
    return [_ALIGN.prepare((1,), *inputs, cursor, sorted_rows, block_pair, block_nrows,
                           num_blocks, PAIRS_P2=pairs_p2, CHUNK=chunk, BM=block_m,
                           num_warps=4 if chunk <= 1024 else 16)]


def align_moe_lora(
    topk_ids: torch.Tensor,
    token_lora: torch.Tensor,
    enabled: torch.Tensor,
    num_experts: int,
    block_m: int,
    naive: bool = False,
    parallel: bool = False,
    slot_ranks: bool = False,
) -> MoELoRABlocks:
    """Sorts rows into (adapter, expert) blocks.

    Args:
        topk_ids: ``[M, K]`` expert of each row (int32; -1 = not local).
        token_lora: ``[>=M]`` int32 adapter slot of each token, -1 for none.
        enabled: ``[>=L]`` int32/bool, nonzero where the slot carries expert LoRA (with
            ``slot_ranks``: the rank of the slot's adapter, which the ops then read up to).
        num_experts: E (local experts).
        block_m: BM, rows per block (a power of two >= 16).
        naive: one row per block, no sort (see the module doc).
        parallel: two launches of one program per ``PARALLEL_CHUNK`` rows (per-chunk histograms,
            then each program places its rows) instead of one program for all rows; the same
            blocks (rows within a block may come in another order). For large batches.
        slot_ranks: ``enabled`` holds ranks (``MoELoRABlocks.slot_ranks``).
    """
    num_tokens, top_k = topk_ids.shape
    num_rows = num_tokens * top_k
    num_slots = enabled.shape[0]
    num_pairs = num_slots * num_experts
    pairs_p2 = next_pow2(num_pairs + 1)
    dev = topk_ids.device
    if enabled.dtype != torch.int32:
        enabled = enabled.to(torch.int32)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    if token_lora.dtype != torch.int32:
        token_lora = token_lora.to(torch.int32)
    if naive:
        dummy = _unused_table(dev)
        return MoELoRABlocks(dummy, dummy, dummy, dummy, num_rows, block_m, num_rows, top_k,
                             num_experts, True, ids, token_lora, enabled, slot_ranks=slot_ranks)
    max_blocks, starts, sizes = block_layout(num_rows, num_pairs, block_m, parallel)
    tables = layout_tables(torch.empty(starts[-1], dtype=torch.int32, device=dev), starts, sizes)
    plans = None
    if num_rows == 0:
        tables[1].zero_()
    else:
        key = (layout_key(num_rows, num_pairs, block_m, parallel), top_k, num_experts,
               num_pairs, aligned16(ids, token_lora, enabled))
        plans = _ALIGN_PLANS.get(key)
        inputs = (ids, token_lora, enabled, num_rows, top_k, num_experts)
        if plans is not None:
            launch_align(plans, raw_stream(dev), inputs, tables)
        else:
            plans = _prepare_align(inputs, parallel, pairs_p2, block_m, *tables)
            _ALIGN_PLANS.put(key, plans)
    cursor, num_blocks, block_pair, block_nrows, sorted_rows, hist = tables
    return MoELoRABlocks(sorted_rows, block_pair, block_nrows, num_blocks, max_blocks, block_m,
                         num_rows, top_k, num_experts, False, ids, token_lora, enabled, plans,
                         slot_ranks)


def layout_tables(ints: torch.Tensor, starts: tuple[int, ...], sizes: tuple[int, ...]
                  ) -> tuple[torch.Tensor, ...]:
    """``(cursor, num_blocks, block_pair, block_nrows, sorted_rows, hist)``: the parts of the
    layout's int32 buffer (``block_layout``)."""
    return tuple(ints[a : a + n] for a, n in zip(starts, sizes))


def launch_align(plans: list, stream: int, inputs: tuple, tables: tuple) -> None:
    """Launches the prepared align launch(es) ``plans`` for ``inputs`` (ids, token_lora,
    enabled, num_rows, top_k, num_experts) into ``tables`` (``layout_tables``)."""
    cursor, num_blocks, block_pair, block_nrows, sorted_rows, hist = tables
    if len(plans) == 2:  # parallel: count, then place
        plans[0].launch(stream, *inputs, hist)
        plans[1].launch(stream, *inputs, hist, plans[1].extra, cursor, sorted_rows, block_pair,
                        block_nrows, num_blocks)
    else:
        plans[0].launch(stream, *inputs, cursor, sorted_rows, block_pair, block_nrows,
                        num_blocks)
