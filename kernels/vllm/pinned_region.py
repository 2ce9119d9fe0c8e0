"""A page-locked host region reserved once at engine start, holding prepared adapters' host copies.

Page-locking fresh host memory (``pin_memory``: cudaHostAlloc) takes the CUDA driver for as long
as the kernel page-locks, and a large MoE adapter's host copy is most of its load's host work
(``kernels.vllm.lora_pinning``). With a region reserved at start, an adapter prepared with
``POOLED`` (``kernels.vllm.lora_loads``) is written into a block of it instead: a memcpy, or the
restack of its experts itself (``kernels.vllm.expert_restack``), no driver call. Blocks are
first-fit, ``ALIGN``-aligned, every host tensor of the adapter a view of one (of two where the
first had no room left). Invariant: a block returns to the free list only once its writer closed
it and every view taken of it has been collected (vLLM dropped the adapter from its CPU cache),
so no live tensor ever shares bytes with another adapter's. A view is what the adapter holds:
nothing may keep a tensor derived from it (a slice, a reshape) past the view itself.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import weakref
from typing import Any

from kernels.vllm.lora_pinning import host_tensor_slots, host_tensors, put_tensor, tensor_at

logger = logging.getLogger("vllm.loraplex")

ALIGN = 256  # bytes; every view starts aligned as an allocator's block would


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def footprint(tensors: Any) -> int:
    """Bytes a block needs for a view of each of ``tensors``."""
    return sum(aligned(t.numel() * t.element_size()) for t in tensors)


class Block:
    """One adapter's bytes, handed out as aligned views in order (``take``, ``put``). The writer's
    own hold keeps it until ``close``; afterwards it returns to the region once every view taken
    has been collected (the views are what the adapter's tensors are)."""

    def __init__(self, region: PinnedRegion, offset: int, size: int) -> None:
        self.region, self.offset, self.size = region, offset, size
        self._pos, self._alive = offset, 1  # the writer's hold
        self._lock = threading.Lock()

    def left(self) -> int:
        return self.offset + self.size - self._pos

    def take(self, shape: Any, dtype: Any) -> Any:
        """An uninitialised view of ``shape`` / ``dtype`` at the next aligned offset; raises
        ``ValueError`` past the block's end."""
        nbytes = math.prod(shape) * dtype.itemsize
        if aligned(nbytes) > self.left():
            raise ValueError(f"a block of {self.size} bytes has {self.left()} left, not {aligned(nbytes)}")
        view = self.region.buffer[self._pos:self._pos + nbytes].view(dtype).view(shape)
        self._pos += aligned(nbytes)
        with self._lock:
            self._alive += 1
        weakref.finalize(view, self._drop)
        return view

    def put(self, tensor: Any) -> Any:
        """A copy of ``tensor`` in the next view."""
        view = self.take(tensor.shape, tensor.dtype)
        view.copy_(tensor)
        return view

    def close(self) -> None:
        """Drops the writer's hold (once)."""
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            self.region.release(self.offset, self.size)


class PinnedRegion:
    """``nbytes`` of host memory (page-locked when ``pin``), handed out in aligned blocks."""

    def __init__(self, nbytes: int, pin: bool = True) -> None:
        import torch

        self.buffer = torch.empty(aligned(nbytes), dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, self.buffer.numel())]  # (offset, size): sorted, coalesced
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor``'s bytes lie in this region."""
        start = self.buffer.data_ptr()
        return start <= tensor.data_ptr() < start + self.nbytes

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free block of ``aligned(nbytes)`` bytes, first fit; None when none fits."""
        size = aligned(nbytes)
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    return offset
        return None

    def block(self, nbytes: int) -> Block | None:
        """A block of at least ``nbytes`` (its writer closes it); None when none fits."""
        offset = self.allocate(nbytes)
        return None if offset is None else Block(self, offset, aligned(nbytes))

    def release(self, offset: int, nbytes: int) -> None:
        """The block at ``offset`` free again, merged with free neighbours."""
        with self._lock:
            bisect.insort(self._free, (offset, aligned(nbytes)))
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged

    def adopt(self, lora_model: Any, block: Block | None = None) -> int:
        """Copies every host tensor of ``lora_model`` not in the region yet into ``block`` (one
        of its own when ``block`` is None or has no room left), each tensor once however many
        names hold it (vLLM's 3-D MoE restack leaves gate_up under two), and replaces it by its
        view wherever it is held (``lora_pinning.put_tensor``, one at a time); the bytes copied,
        or 0 when no block fits (nothing changed) or nothing is left. A given block stays open."""
        distinct = [t for t in host_tensors(lora_model) if not self.holds(t)]
        if not distinct:
            return 0
        need = footprint(distinct)
        own = block is None or block.left() < need
        if own:
            block = self.block(need)
            if block is None:
                return 0
        try:
            views = {id(t): block.put(t) for t in distinct}
        finally:
            if own:
                block.close()
        for slot in host_tensor_slots(lora_model):
            if (view := views.get(id(tensor_at(slot)))) is not None:
                put_tensor(slot, view)
        return sum(t.numel() * t.element_size() for t in distinct)


_region: PinnedRegion | None = None
_reserve_lock = threading.Lock()


def reserve(nbytes: int, pin: bool) -> tuple[int, float]:
    """This process's region of at least ``nbytes`` (kept when one that large exists; none is made
    where ``pin`` is False: nothing can be page-locked); ``(its bytes, seconds spent)``."""
    global _region
    t0 = time.perf_counter()
    with _reserve_lock:
        if pin and nbytes > 0 and (_region is None or _region.nbytes < nbytes):
            if _region is not None and _region.free_bytes() != _region.nbytes:
                raise RuntimeError("the pinned region holds adapters: it can only grow while empty")
            _region = PinnedRegion(nbytes)
            logger.info("pinned region of %.0f MiB reserved in %.3f s", _region.nbytes / (1 << 20),
                        time.perf_counter() - t0)
        return (_region.nbytes if _region is not None else 0), time.perf_counter() - t0


def block(nbytes: int) -> Block | None:
    """A block of this process's region (its writer closes it); None where there is none or no room."""
    region = _region
    return region.block(nbytes) if region is not None else None


def adopt(lora_model: Any, into: Block | None = None) -> int:
    """``lora_model``'s host copy moved into this process's region (``into`` first where given);
    0 where there is none or it is full."""
    region = _region
    return region.adopt(lora_model, into) if region is not None else 0


def forget() -> None:
    """Drops this process's region (tests; blocks still viewed keep its memory alive)."""
    global _region
    with _reserve_lock:
        _region = None
