"""Adapter loads off the engine's loop: vLLM's host work for ``add_lora`` done beforehand, in a
thread of the worker, on several torch threads.

vLLM runs ``add_lora`` inside the engine core's busy loop: reading the files, reshaping 3-D expert
tensors into its slot layout, folding the scaling into B and pinning every tensor happen there,
one adapter after another, and every stream of the batch waits meanwhile. Here the worker
prepares the adapter first (``prepare``, through ``LoraplexWorkerExtension``): a thread of its own
runs vLLM's loader (``WorkerLoRAManager._load_adapter``, the original; tensors read unpinned) and
its manager's ``_create_merged_loras_inplace`` with ``threads`` intra-op threads, then pins the
result or leaves that for after its first activation (``kernels.vllm.lora_pinning``); the engine's loop
keeps stepping. The frontend's ``add_lora`` then finds the prepared ``LoRAModel`` (the wrapped
``_load_adapter`` returns it), and the manager's own merge pass, run again at registration, finds
nothing left to do (packed already, scaling 1, experts restacked).

``LORAPLEX_PROFILE_ADAPTER_LOADS=DIR`` in the engine's environment profiles preparations
(``cProfile``) into ``DIR/<adapter>.pstats`` and logs their costliest calls. One at a time: on
Python 3.12 a profile is process-wide (every thread's calls) and a second cannot start while one
runs, so a preparation that starts meanwhile runs unprofiled.

Invariant: an entry lives from ``prepare`` until ``add_lora`` takes it or ``discard`` drops it; a
failed preparation is dropped when reported, so the plain ``add_lora`` after it loads again inside
the loop and raises vLLM's own error.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kernels.vllm import expert_restack, lora_pinning, pinned_region
from kernels.vllm.patching import Patches

logger = logging.getLogger("vllm.loraplex")
PROFILE_ENV = "LORAPLEX_PROFILE_ADAPTER_LOADS"
LOAD_WORKERS = 2  # adapters prepared at once

_lock = threading.Lock()
_prepared: dict[int, Future] = {}  # lora_int_id -> the LoRAModel being prepared
_pool: ThreadPoolExecutor | None = None
_original_load: Any = None  # WorkerLoRAManager._load_adapter as wrapped last (vLLM's, or an earlier wrapper of ours)
_local = threading.local()  # .preparing: this thread prepares a load (the wrappers must not take it)
_profiling = threading.Lock()  # held while a preparation is profiled


def install(patches: Patches) -> None:
    """Wraps ``WorkerLoRAManager._load_adapter`` so a prepared adapter is taken, not loaded again;
    pinning moves out of vLLM's reader and merge pass (``kernels.vllm.lora_pinning``)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    lora_pinning.install(patches)

    def make(load):
        global _original_load
        _original_load = load

        def _load_adapter(self, lora_request):
            if getattr(_local, "preparing", False):  # the preparing thread itself: load (through any inner wrapper)
                return load(self, lora_request)
            with _lock:
                pending = _prepared.pop(lora_request.lora_int_id, None)
            if pending is not None:
                try:
                    return pending.result()
                except Exception:  # noqa: BLE001 - loaded again below: vLLM's own error, in its own way
                    pass
            return load(self, lora_request)

        return _load_adapter

    patches.wrap(WorkerLoRAManager, "_load_adapter", make)


def prepare(manager: Any, lora_request: Any, threads: int, pinning: lora_pinning.Pinning = lora_pinning.EAGER) -> bool:
    """Starts preparing ``lora_request`` for ``manager`` (the worker's ``WorkerLoRAManager``), its
    host copy pinned before ``add_lora`` (``EAGER``; ``POOLED`` where the region has no room),
    copied into the pinned region (``POOLED``) or pinned after its first activation (``DEFERRED``);
    False when it is registered or being prepared already."""
    global _pool
    if _original_load is None:
        raise RuntimeError("loraplex's adapter loads are not installed in this process")
    modes = (lora_pinning.EAGER, lora_pinning.DEFERRED, lora_pinning.POOLED)
    if pinning not in modes:
        raise ValueError(f"pinning must be one of {', '.join(map(repr, modes))}, not {pinning!r}")
    with _lock:
        if lora_request.lora_int_id in _prepared or lora_request.lora_int_id in manager.list_adapters():
            return False
        if _pool is None:
            _pool = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="loraplex-lora-load")
        _prepared[lora_request.lora_int_id] = _pool.submit(_load, manager, lora_request, threads, pinning)
    return True


def _load(manager: Any, lora_request: Any, threads: int, pinning: str) -> Any:
    folder = os.environ.get(PROFILE_ENV)
    if not folder or not _profiling.acquire(blocking=False):  # one profile at a time (see the module's doc)
        return _prepare(manager, lora_request, threads, pinning)
    try:
        return _profiled(folder, manager, lora_request, threads, pinning)
    finally:
        _profiling.release()


def _profiled(folder: str, manager: Any, lora_request: Any, threads: int, pinning: str) -> Any:
    import cProfile
    import io
    import pstats
    from pathlib import Path

    profile = cProfile.Profile()
    try:
        profile.enable()
    except ValueError as e:  # another profiler of this process (a debugger, a sampler): none here
        logger.warning("adapter %s: preparation not profiled: %s", lora_request.lora_name, e)
        return _prepare(manager, lora_request, threads, pinning)
    try:
        return _prepare(manager, lora_request, threads, pinning)
    finally:
        profile.disable()
        try:
            out = Path(folder) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', lora_request.lora_name)}.pstats"
            out.parent.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(out)
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
            logger.info("adapter %s preparation profile, every thread of the process (%s):\n%s",
                        lora_request.lora_name, out, text.getvalue())
        except Exception:  # noqa: BLE001 - the profile is lost, the preparation is not
            logger.exception("adapter %s: writing the preparation's profile failed", lora_request.lora_name)


def _prepare(manager: Any, lora_request: Any, threads: int, pinning: str) -> Any:
    import torch

    if threads > 0:  # OpenMP: this thread's parallel regions; the loop thread keeps its own count
        torch.set_num_threads(min(threads, len(os.sched_getaffinity(0))))
    t0 = time.perf_counter()
    _local.preparing = True
    try:
        lora = _original_load(manager, lora_request)
    finally:
        _local.preparing = False
    t1 = time.perf_counter()
    setattr(lora, lora_pinning.MARK, lora_pinning.PREPARING)  # the merge pass below leaves pinning to us
    adapter_manager = manager._adapter_manager
    pooled = pinning == lora_pinning.POOLED and lora_pinning.pin_available()
    block = _block_for(lora) if pooled and expert_restack.restacked_modules(adapter_manager) else None
    try:
        restacked = expert_restack.restack_into(adapter_manager, lora, block) if block is not None else 0
        t2 = time.perf_counter()
        adapter_manager._create_merged_loras_inplace(lora)
        t3 = time.perf_counter()
        copied = pinned_region.adopt(lora, block) if pooled else 0
    finally:
        if block is not None:
            block.close()
    if restacked or copied:
        setattr(lora, lora_pinning.MARK, lora_pinning.PINNED)
        pinned = (f"restack into the pinned region {t2 - t1:.3f} s ({restacked / (1 << 20):.0f} MiB), " if restacked else "") \
            + f"copy into it {time.perf_counter() - t3:.3f} s ({copied / (1 << 20):.0f} MiB)"
        if not copied and any(not t.is_pinned() for t in lora_pinning.host_tensors(lora)):  # leftovers: no room
            size, seconds = lora_pinning.pin(lora)
            pinned += f", pin of what found no room {seconds:.3f} s ({size / (1 << 20):.0f} MiB)"
    elif pinning == lora_pinning.DEFERRED:
        setattr(lora, lora_pinning.MARK, lora_pinning.DEFERRED)
        pinned = "pinning after its first activation"
    else:  # eager, or pooled with no room in the region
        size, seconds = lora_pinning.pin(lora)
        pinned = f"pin {seconds:.3f} s ({size / (1 << 20):.0f} MiB)" + (" (no room in the pinned region)" if pooled else "")
    t4 = time.perf_counter()
    logger.info("adapter %s prepared off the loop in %.3f s: read %.3f s, merge %.3f s, %s (%d torch threads; "
                "OMP_NUM_THREADS=%s)", lora_request.lora_name, t4 - t0, t1 - t0, t3 - t2, pinned,
                torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
    return lora


def _block_for(lora: Any) -> pinned_region.Block | None:
    """A block of the pinned region for every host tensor of ``lora`` (a restack moves bytes, it
    adds none); None where the region has no room."""
    return pinned_region.block(pinned_region.footprint(lora_pinning.host_tensors(lora)))


def ready(lora_int_id: int) -> bool:
    """Whether nothing is being prepared for ``lora_int_id`` any more: prepared (``add_lora`` takes
    it), failed (dropped and logged), or never asked for."""
    with _lock:
        pending = _prepared.get(lora_int_id)
        if pending is None:
            return True
        if not pending.done():
            return False
        if pending.exception() is not None:
            del _prepared[lora_int_id]
            logger.warning("preparing adapter %d failed (add_lora loads it again): %s", lora_int_id,
                           pending.exception())
        return True


def discard(lora_int_id: int) -> bool:
    """Drops a preparation that ``add_lora`` will not take (its request went away); True if one was held."""
    with _lock:
        pending = _prepared.pop(lora_int_id, None)
    if pending is not None:
        pending.cancel()
    return pending is not None


def held() -> list[int]:
    """``lora_int_id``s prepared or being prepared and not yet taken."""
    with _lock:
        return sorted(_prepared)


def reset() -> None:
    """Forgets every preparation, the wrapped loader and scheduled pinning (a process's patches
    undone; tests)."""
    global _original_load
    _original_load = None
    lora_pinning.reset()
    with _lock:
        for f in _prepared.values():
            f.cancel()
        _prepared.clear()
