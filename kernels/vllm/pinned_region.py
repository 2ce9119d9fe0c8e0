"""A page-locked host region reserved once at engine start, holding prepared adapters' host copies.

Page-locking fresh host memory (``pin_memory``: cudaHostAlloc) takes the CUDA driver for as long
as the kernel page-locks, and a large MoE adapter's host copy is most of its load's host work
(``kernels.vllm.lora_pinning``). With a region reserved at start, an adapter prepared with
``POOLED`` (``kernels.vllm.lora_loads``) is copied into one block of it instead: a memcpy, no
driver call. Blocks are first-fit, ``ALIGN``-aligned, one per adapter, every host tensor of the
adapter a view of it. Invariant: a block returns to the free list only once every view made of
it has been collected (vLLM dropped the adapter from its CPU cache), so no live tensor ever
shares bytes with another adapter's.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from typing import Any

from kernels.vllm.lora_pinning import host_tensor_slots, put_tensor, tensor_at

logger = logging.getLogger("vllm.loraplex")

ALIGN = 256  # bytes; every view starts aligned as an allocator's block would


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Block:
    """One adapter's bytes; released when its last view is collected."""

    def __init__(self, region: PinnedRegion, offset: int, size: int, views: int) -> None:
        self.region, self.offset, self.size, self.alive = region, offset, size, views
        self._lock = threading.Lock()

    def view_collected(self) -> None:
        with self._lock:
            self.alive -= 1
            last = self.alive == 0
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

    def copy_in(self, tensors: list[Any]) -> tuple[int, int, list[Any]] | None:
        """One block holding a copy of each of ``tensors``, each an aligned view of it, in order:
        ``(its offset, its size, the views)``; None when no block fits."""
        sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
        offset = self.allocate(sum(sizes))
        if offset is None:
            return None
        views, pos = [], offset
        for t, size in zip(tensors, sizes):
            view = self.buffer[pos:pos + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
            pos += size
        return offset, sum(sizes), views

    def adopt(self, lora_model: Any) -> int:
        """Copies every host tensor of ``lora_model`` into one block and replaces each by its view
        (``lora_pinning.put_tensor``, one at a time); the bytes copied, or 0 when no block fits
        (nothing changed)."""
        slots = host_tensor_slots(lora_model)
        tensors = [tensor_at(s) for s in slots]
        placed = self.copy_in(tensors) if tensors else None
        if placed is None:
            return 0
        offset, size, views = placed
        block = _Block(self, offset, size, len(views))
        for slot, view in zip(slots, views):
            weakref.finalize(view, block.view_collected)
            put_tensor(slot, view)
        return sum(t.numel() * t.element_size() for t in tensors)


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


def adopt(lora_model: Any) -> int:
    """``lora_model``'s host copy moved into this process's region; 0 where there is none or it is full."""
    region = _region
    return region.adopt(lora_model) if region is not None else 0


def forget() -> None:
    """Drops this process's region (tests; blocks still viewed keep its memory alive)."""
    global _region
    with _reserve_lock:
        _region = None
