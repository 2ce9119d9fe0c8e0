"""Engine residency: the one table of adapters registered with this replica's vLLM engine.

The table is the single truth: an adapter is registered with the engine (``add_lora``) if and
only if it has a row here. Capacity = the engine's ``max_cpu_loras`` rows and, where set, a byte
budget for their host copies (``capacity_bytes``, counted as the adapters' file bytes): a new row
evicts as many idle rows as it needs to fit both. Rows are kept in LRU order; a row is pinned
while requests use it (``active > 0``) or by the operator, and only idle, unpinned rows are
evicted. Eviction calls ``remove_lora`` first and releases the disk
cache pin after it returned, so the cache can never delete a folder the engine may still
reload from (which would kill a vLLM engine). vLLM's own LRU never evicts because the table
never registers more than ``max_cpu_loras`` adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol

from .cache import AdapterCache
from .errors import (
    AdapterConflict,
    AdapterInvalid,
    AdapterLoadFailed,
    RegistryError,
    SlotsExhausted,
    SlotsTooSmall,
)
from .events import NO_OBSERVER, RegistryObserver
from .manifest import AdapterManifest, BaseModelInfo
from .stores.base import AdapterStore
from .validation import inspect_adapter

log = logging.getLogger(__name__)


class EngineLoraOps(Protocol):
    """The two vLLM ``AsyncLLM`` methods the table drives."""

    async def add_lora(self, lora_request: Any) -> bool: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...


RequestFactory = Callable[[AdapterManifest, int, Path], Any]


def engine_lora_name(manifest: AdapterManifest) -> str:
    """The name the engine knows an adapter version by: ``<id>@v<version>.<digest prefix>``.

    It names the content, not only the version: vLLM 0.24 keys prefix-cache blocks by the LoRA
    name alone, so other bytes under a reused ``<id>@v<version>`` (a store wiped and re-pushed)
    would otherwise reuse the old adapter's cached KV blocks.
    """
    return f"{manifest.lora_name}.{manifest.content_digest[:12]}"


def vllm_lora_request(manifest: AdapterManifest, lora_int_id: int, path: Path) -> Any:
    """``vllm.lora.request.LoRARequest`` named by :func:`engine_lora_name`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=engine_lora_name(manifest), lora_int_id=lora_int_id, lora_path=str(path))


@dataclass
class Slot:
    """One row: an adapter version registered (or being registered) with the engine."""

    manifest: AdapterManifest
    lora_int_id: int
    active: int = 0
    operator_pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    request: Any = None
    path: Path | None = None
    ready: asyncio.Future | None = None
    load_steps: dict[str, float] | None = None  # its load's seconds: disk (victim unregistered first), checks, add_lora
    loaded_at: float | None = None  # time.monotonic() when its load ended

    @property
    def loaded(self) -> bool:
        return self.ready is not None and self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    def view(self) -> dict:
        return {
            "adapter_id": self.manifest.adapter_id,
            "version": self.manifest.version,
            "lora_name": self.manifest.lora_name,
            "lora_int_id": self.lora_int_id,
            "bytes": self.manifest.total_bytes,
            "active_requests": self.active,
            "operator_pinned": self.operator_pinned,
            "loaded": self.loaded,
            "idle_s": round(time.monotonic() - self.last_used, 3),
        }


class AdapterSlots:
    """LRU table of engine-registered adapters with pinning (see module doc)."""

    def __init__(
        self,
        engine: EngineLoraOps,
        cache: AdapterCache,
        capacity: int,
        *,
        request_factory: RequestFactory = vllm_lora_request,
        acquire_timeout_s: float = 30.0,
        base: BaseModelInfo | None = None,
        max_lora_rank: int | None = None,
        observer: RegistryObserver = NO_OBSERVER,
        capacity_bytes: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1 (or None: rows alone bound the table)")
        self.engine = engine
        self.cache = cache
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.request_factory = request_factory
        self._table: OrderedDict[str, Slot] = OrderedDict()
        self._next_int_id = 1
        self.acquire_timeout_s = acquire_timeout_s
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.observer = observer
        self._freed = asyncio.Event()
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "failures": 0}
        self._report_residency()

    # ---- reports --------------------------------------------------------------------------------
    def resident(self) -> list[str]:
        """Adapter ids with a loaded row (for Ray Serve's multiplexed-model report), LRU order."""
        seen: dict[str, None] = {}
        for s in self._table.values():
            if s.loaded:
                seen[s.manifest.adapter_id] = None
        return list(seen)

    def snapshot(self) -> list[dict]:
        """Rows in LRU order (least recently used first)."""
        return [s.view() for s in self._table.values()]

    def _report_residency(self) -> None:
        """Tells the observer which rows are registered with the engine now."""
        registered = [s.manifest.adapter_id for s in self._table.values() if s.request is not None]
        self.observer.residency(registered, self.capacity)

    @property
    def free_slots(self) -> int:
        """Rows a new adapter could take without an eviction; under a byte budget, no more than the
        adapters of the table's mean size that its free bytes hold."""
        free = self.capacity - len(self._table)
        if self.capacity_bytes is None or not self._table:
            return free
        used = self.registered_bytes
        return min(free, (self.capacity_bytes - used) * len(self._table) // max(used, 1))

    @property
    def registered_bytes(self) -> int:
        """File bytes of every row's adapter (loading ones included: their room is reserved)."""
        return sum(s.manifest.total_bytes for s in self._table.values())

    def active(self) -> list[str]:
        """Adapter ids that requests are using now (each pins its row)."""
        return sorted({s.manifest.adapter_id for s in self._table.values() if s.active})

    @property
    def loadable_slots(self) -> int:
        """Rows a new adapter could take now: free ones and idle, unpinned, loaded ones."""
        return self.free_slots + sum(1 for s in self._table.values()
                                     if not s.active and not s.operator_pinned and s.loaded)

    # ---- the request path -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, store: AdapterStore, manifest: AdapterManifest) -> AsyncIterator[Any]:
        """Make ``manifest`` resident and yield its ``LoRARequest``; the row stays pinned inside.

        When every row is busy, waits up to ``acquire_timeout_s`` for one to become idle, then
        raises :class:`SlotsExhausted` (503 with a retry hint).
        """
        async with self.use_slot(store, manifest) as slot:
            yield slot.request

    @contextlib.asynccontextmanager
    async def use_slot(self, store: AdapterStore, manifest: AdapterManifest) -> AsyncIterator[Slot]:
        """:meth:`use`, yielding the row (its ``load_steps`` say what a load this request waited for cost)."""
        slot = await self._acquire(store, manifest)
        try:
            yield slot
        finally:
            self._release(slot)

    async def _acquire(self, store: AdapterStore, manifest: AdapterManifest) -> Slot:
        name = manifest.lora_name
        deadline = time.monotonic() + self.acquire_timeout_s
        while True:
            slot = self._table.get(name)
            if slot is not None and slot.manifest.content_digest != manifest.content_digest:
                if slot.active or slot.operator_pinned:
                    raise AdapterConflict(f"{name} is resident with other content and in use; retry shortly")
                self._table.pop(name)
                await self._unregister(slot)
                continue
            if slot is not None:
                self.stats["hits"] += 1
                self.observer.lookup("engine", hit=True)
                slot.active += 1
                slot.last_used = time.monotonic()
                self._table.move_to_end(name)
                break
            try:
                victims = self._reserve_room(manifest)
            except SlotsExhausted:
                freed = self._freed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                try:
                    await asyncio.wait_for(freed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                continue  # state changed (or time is up): look again
            self.stats["misses"] += 1
            self.observer.lookup("engine", hit=False)
            slot = Slot(manifest, self._next_int_id, active=1)
            self._next_int_id += 1
            self._table[name] = slot
            slot.ready = asyncio.ensure_future(self._load(slot, store, victims))
            slot.ready.add_done_callback(_retrieve)
            break
        try:
            await asyncio.shield(slot.ready)
        except BaseException:
            self._release(slot)
            raise
        return slot

    def _release(self, slot: Slot) -> None:
        slot.active -= 1
        slot.last_used = time.monotonic()
        if slot.active == 0:
            self._signal()

    def _signal(self) -> None:
        """Wake requests waiting for a slot (a row became idle or left the table)."""
        self._freed.set()
        self._freed = asyncio.Event()

    def _reserve_room(self, manifest: AdapterManifest) -> list[Slot]:
        """Take LRU idle rows out of the table until ``manifest`` fits the rows and the byte budget
        (synchronous: no race); nothing is taken when they cannot make room."""
        name, size = manifest.lora_name, manifest.total_bytes
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            raise SlotsTooSmall(
                f"{name} is {size} bytes, more than this replica's whole budget for registered adapters "
                f"({self.capacity_bytes} bytes); raise engine.max_cpu_lora_gib"
            )
        def fits(rows: int, used: int) -> bool:
            return rows < self.capacity and (self.capacity_bytes is None or used + size <= self.capacity_bytes)

        rows, used = len(self._table), self.registered_bytes
        victims: list[Slot] = []
        for s in self._table.values():
            if fits(rows, used):
                break
            if not s.active and not s.operator_pinned and s.loaded:
                victims.append(s)
                rows, used = rows - 1, used - s.manifest.total_bytes
        if not fits(rows, used):
            busy = ", ".join(f"{k} ({s.active} active{', pinned' if s.operator_pinned else ''})"
                             for k, s in self._table.items() if s.active or s.operator_pinned or not s.loaded)
            bound = (f"all {self.capacity} adapter slots" if len(self._table) >= self.capacity else
                     f"the {self.capacity_bytes}-byte budget for registered adapters")
            raise SlotsExhausted(
                f"{bound} of this replica are in use ({busy}); {name} cannot be loaded now, "
                "retry shortly or raise engine.max_cpu_loras / engine.max_cpu_lora_gib"
            )
        for s in victims:
            del self._table[s.manifest.lora_name]
        return victims

    async def _load(self, slot: Slot, store: AdapterStore, victims: list[Slot]) -> None:
        name = slot.manifest.lora_name
        t0 = time.perf_counter()
        try:
            for victim in victims:
                await self._unregister(victim)
            path = await self.cache.ensure_local(store, slot.manifest, pin=True)
            t_disk = time.perf_counter()
            if self.base is not None or self.max_lora_rank is not None:
                try:
                    await asyncio.to_thread(self._check_before_load, slot.manifest, path)
                except BaseException:
                    self.cache.unpin(slot.manifest)
                    raise
            t_check = time.perf_counter()
            try:
                request = self.request_factory(slot.manifest, slot.lora_int_id, path)
                ok = await self.engine.add_lora(request)
                if not ok:
                    raise AdapterLoadFailed(f"the engine refused to register {name}")
            except BaseException as e:
                with contextlib.suppress(Exception):
                    await self.engine.remove_lora(slot.lora_int_id)
                self.cache.unpin(slot.manifest)
                if isinstance(e, RegistryError) or not isinstance(e, Exception):
                    raise
                if isinstance(e, (ValueError, TypeError)):  # vLLM's way to reject an adapter's content
                    raise AdapterInvalid(f"the engine refused {name}: {e}") from e
                raise AdapterLoadFailed(f"the engine failed to register {name}: {type(e).__name__}: {e}") from e
            slot.request, slot.path = request, path
            t_end = time.perf_counter()
            slot.load_steps = {"disk_s": t_disk - t0, "checks_s": t_check - t_disk, "add_lora_s": t_end - t_check}
            slot.loaded_at = time.monotonic()
            self.observer.loaded("engine", t_end - t0)
            self._report_residency()
        except BaseException as e:
            if self._table.get(name) is slot:
                del self._table[name]
                self._signal()
            self.stats["failures"] += 1
            self.observer.failed("engine", type(e).__name__)
            raise

    def _check_before_load(self, manifest: AdapterManifest, path: Path) -> None:
        """Validation again, against this engine: base architecture, rank limit, tensor names and
        shapes (headers only; the bytes were sha256-verified against the validated manifest)."""
        if self.base is not None and manifest.base_model.architecture != self.base.architecture:
            raise AdapterInvalid(
                f"{manifest.lora_name} was validated against {manifest.base_model.architecture}; "
                f"this engine serves {self.base.architecture}"
            )
        rank = self.max_lora_rank or 10**9
        if manifest.rank > rank:
            raise AdapterInvalid(f"{manifest.lora_name} has rank {manifest.rank}, above this engine's max_lora_rank {rank}")
        if self.base is not None:
            inspect_adapter(path, self.base, rank, check_values=False)

    async def _unregister(self, slot: Slot) -> None:
        """``remove_lora`` first; only then may the cache delete the folder."""
        self.stats["evictions"] += 1
        self.observer.evicted("engine")
        try:
            await self.engine.remove_lora(slot.lora_int_id)
        except Exception:
            # The engine may still hold the folder: keep the cache pin (a leak beats a dead engine).
            log.exception("remove_lora(%s) failed; keeping its files", slot.manifest.lora_name)
            return
        self.cache.unpin(slot.manifest)
        self._report_residency()
        self._signal()

    # ---- operator actions -----------------------------------------------------------------------
    async def pin(self, store: AdapterStore, manifest: AdapterManifest) -> None:
        """Load ``manifest`` if needed and keep it resident until :meth:`unpin`."""
        pinned = [s for s in self._table.values() if s.operator_pinned]
        row = self._table.get(manifest.lora_name)
        if row is None or not row.operator_pinned:
            if len(pinned) + 1 >= self.capacity and self.capacity > 1:
                raise AdapterConflict(
                    f"pinning {manifest.lora_name} would leave no evictable slot ({len(pinned)} of {self.capacity} "
                    "pinned); unpin another adapter first"
                )
            held = sum(s.manifest.total_bytes for s in pinned) + manifest.total_bytes
            if self.capacity_bytes is not None and held > self.capacity_bytes // 2:
                raise AdapterConflict(
                    f"pinning {manifest.lora_name} would put {held} bytes of pinned adapters in this replica's "
                    f"{self.capacity_bytes}-byte budget (at most half may be pinned); unpin another adapter first"
                )
        async with self.use(store, manifest):
            self._table[manifest.lora_name].operator_pinned = True

    def unpin(self, adapter_id: str) -> int:
        """Clear the operator pin of every resident version of ``adapter_id``; returns rows changed."""
        n = 0
        for s in self._table.values():
            if s.manifest.adapter_id == adapter_id and s.operator_pinned:
                s.operator_pinned = False
                n += 1
        return n

    async def retire(self, adapter_id: str, keep_version: int | None = None) -> int:
        """Unregister idle rows of ``adapter_id`` (all versions but ``keep_version``); busy rows stay
        until LRU eviction. Call after a delete or a new version. Returns rows removed."""
        rows = [
            s for s in self._table.values()
            if s.manifest.adapter_id == adapter_id and s.manifest.version != keep_version
            and not s.active and s.loaded
        ]
        for s in rows:
            if self._table.get(s.manifest.lora_name) is s:
                del self._table[s.manifest.lora_name]
                await self._unregister(s)
        return len(rows)

    async def clear(self) -> None:
        """Unregister every idle row (shutdown)."""
        for s in [s for s in self._table.values() if not s.active and s.loaded]:
            self._table.pop(s.manifest.lora_name, None)
            await self._unregister(s)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
