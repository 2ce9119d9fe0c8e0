"""When an adapter's host copy is page-locked, and on which thread.

vLLM pins an adapter's host tensors in its merge pass (``_create_merged_loras_inplace``), inside
``add_lora``; pinned, a copy into a GPU slot is a DMA instead of a staged copy. Page-locking
fresh host memory is most of an MoE adapter's host work in a load. Installed, vLLM's reader and
merge pass no longer pin (``lora_model.PIN_MEMORY``, ``model_manager.PIN_MEMORY``) and this
module does, with vLLM's rule (every host tensor of every module, once, after the merge):

- a load vLLM makes itself (nothing prepared it): right after its merge pass, as vLLM does;
- a load prepared off the loop (``kernels.vllm.lora_loads``) with ``EAGER``: by the preparing
  thread, before ``add_lora`` takes it;
- with ``POOLED``: copied by the preparing thread into a block of the page-locked region reserved
  at start (``kernels.vllm.pinned_region``: no page-locking in the load), else as ``EAGER``;
- with ``DEFERRED``: after its first activation (``add_lora`` registers an adapter and copies it
  into a GPU slot at once), by a thread of this module, while the adapter already serves: the
  first copy into a slot reads pageable memory (the same values) and no longer runs beside the
  page-locking, which slowed it several-fold; the page-locking runs beside the engine's next
  steps instead, and stalls them (benchmarks/RESULTS.md: the slowest mode for a cold request and
  for the streams beside it).

Invariant: a tensor is replaced by its pinned copy, never changed in place, one attribute or list
item at a time, so a copy into a slot made meanwhile reads either and gets the same values. The
mark ``MARK`` on a ``LoRAModel`` says where it stands: ``PREPARING`` (a preparing thread merges
it: not pinned here), ``DEFERRED`` (pinned once activated), ``PINNING``, ``PINNED``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Literal

from kernels.vllm.patching import Patches

logger = logging.getLogger("vllm.loraplex")

Pinning = Literal["eager", "deferred", "pooled"]
EAGER: Pinning = "eager"
DEFERRED: Pinning = "deferred"
POOLED: Pinning = "pooled"  # copied into the region reserved at start (kernels.vllm.pinned_region), else EAGER
MARK = "_loraplex_pinning"
PREPARING, PINNING, PINNED = "preparing", "pinning", "pinned"

_pin_available = False  # vLLM's own PIN_MEMORY where installed: a CUDA host
_pin_tensor: Callable[[Any], Any] = lambda t: t.pin_memory()  # noqa: E731
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pending: set[Future] = set()


def install(patches: Patches) -> None:
    """vLLM's reader and merge pass stop pinning; the merge pass is wrapped to pin vLLM's own
    loads, the activation (``activate_adapter``) to schedule the pinning of a deferred adapter."""
    global _pin_available
    import vllm.lora.lora_model as lora_model_module
    import vllm.lora.model_manager as model_manager_module
    from vllm.utils import torch_utils

    _pin_available = bool(torch_utils.PIN_MEMORY)  # the source of both modules' flag: never patched
    patches.replace(lora_model_module, "PIN_MEMORY", False)
    patches.replace(model_manager_module, "PIN_MEMORY", False)

    def make_merge(merge):
        def _create_merged_loras_inplace(self, lora_model):
            merge(self, lora_model)
            if getattr(lora_model, MARK, None) is None:  # vLLM's own load: pinned where vLLM pins it
                pin(lora_model)

        return _create_merged_loras_inplace

    def make_activate(activate):
        def activate_adapter(self, lora_id):
            activated = activate(self, lora_id)
            lora_model = self._registered_adapters.get(lora_id)
            if getattr(lora_model, MARK, None) == DEFERRED:  # a prepared load, in its first slot now
                schedule(lora_model)
            return activated

        return activate_adapter

    manager = model_manager_module.LoRAModelManager
    patches.wrap(manager, "_create_merged_loras_inplace", make_merge)
    patches.wrap(manager, "activate_adapter", make_activate)  # the LRU manager's calls it (super)


Slot = tuple[Any, str, "int | None"]  # (layer weights, "lora_a" or "lora_b", list index or None)


def host_tensor_slots(lora_model: Any) -> list[Slot]:
    """Where every CPU tensor of ``lora_model`` sits (packed modules hold a list, with None gaps)."""
    out: list[Slot] = []
    for lora in lora_model.loras.values():
        for side in ("lora_a", "lora_b"):
            value = getattr(lora, side)
            if isinstance(value, list):
                out.extend((lora, side, i) for i, t in enumerate(value) if t is not None and t.device.type == "cpu")
            elif value is not None and value.device.type == "cpu":
                out.append((lora, side, None))
    return out


def tensor_at(slot: Slot) -> Any:
    lora, side, i = slot
    value = getattr(lora, side)
    return value if i is None else value[i]


def put_tensor(slot: Slot, tensor: Any) -> None:
    """Replaces the tensor at ``slot`` (the module's invariant: replaced, never changed in place)."""
    lora, side, i = slot
    if i is None:
        setattr(lora, side, tensor)
    else:
        getattr(lora, side)[i] = tensor


def host_tensors(lora_model: Any) -> list[Any]:
    """Every CPU tensor of ``lora_model``, once each (what a pin or a copy into a slot moves)."""
    return list({id(t): t for t in map(tensor_at, host_tensor_slots(lora_model))}.values())


def pin(lora_model: Any) -> tuple[int, float]:
    """Replaces every host tensor of ``lora_model`` by its pinned copy (a no-op where nothing can
    be pinned) and marks it ``PINNED``; ``(bytes pinned, seconds)``."""
    t0 = time.perf_counter()
    done = 0
    if _pin_available:
        copies: dict[int, tuple[Any, Any]] = {}  # id -> (the original, kept alive: ids stay unique; its copy)
        for slot in host_tensor_slots(lora_model):
            t = tensor_at(slot)
            if t.is_pinned():
                continue
            if id(t) not in copies:  # a tensor held under two names (vLLM's 3-D MoE restack) is pinned once
                copies[id(t)] = (t, _pin_tensor(t))
                done += t.numel() * t.element_size()
            put_tensor(slot, copies[id(t)][1])
    setattr(lora_model, MARK, PINNED)
    return done, time.perf_counter() - t0


def pin_available() -> bool:
    """Whether host memory can be page-locked here (vLLM's own flag: a CUDA host)."""
    return _pin_available


def schedule(lora_model: Any) -> None:
    """Pins ``lora_model`` in this module's thread (it serves meanwhile) and marks it ``PINNING``."""
    global _pool
    if not _pin_available:
        setattr(lora_model, MARK, PINNED)
        return
    setattr(lora_model, MARK, PINNING)
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-lora-pin")
        future = _pool.submit(_pin_logged, lora_model)
        _pending.add(future)
    future.add_done_callback(_forget)


def _pin_logged(lora_model: Any) -> None:
    try:
        size, seconds = pin(lora_model)
    except Exception:  # noqa: BLE001 - left pageable: it serves as it is, more slowly into slots
        setattr(lora_model, MARK, PINNED)
        logger.exception("pinning adapter %s after its first activation failed; it stays in pageable memory",
                         lora_model.id)
        return
    logger.info("adapter %s pinned after its first activation in %.3f s (%.0f MiB)", lora_model.id, seconds,
                size / (1 << 20))


def _forget(future: Future) -> None:
    with _lock:
        _pending.discard(future)


def drain(timeout: float | None = None) -> bool:
    """Waits for the pinning scheduled so far; False if some is still running after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            pending = list(_pending)
        if not pending:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        try:
            pending[0].result(left)
        except Exception:  # noqa: BLE001 - logged by the job
            pass


def reset() -> None:
    """Waits for scheduled pinning and forgets the pool (a process's patches undone; tests)."""
    global _pool
    drain()
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)
