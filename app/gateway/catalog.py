"""The gateway's view of the adapter store: adapter id → latest manifest, with a short TTL.

Store reads are blocking (boto3 / filesystem) and run in a worker thread, one per id at a time.
A hit younger than ``ttl_s`` is served from memory, so a freshly pushed adapter or version is
callable within ``ttl_s``. The read that keeps a used entry fresh is off the request path: a hit
older than ``refresh_after_s`` (half the TTL by default) is served at once and starts a background
read of that id (stale-while-revalidate within the TTL), so under steady traffic no request waits
for the store. Only a miss, or an entry past ``ttl_s``, reads the store before answering. Unknown
ids are remembered for ``negative_ttl_s``. While the store is unavailable or slower than
``stale_wait_s``, the last manifest read is served (logged), so adapters keep being served during a
store outage; only ids never read answer 503. Each manifest's JSON dump (what the engine receives)
is made once per manifest, not per request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from adapters_registry.errors import AdapterNotFound, StoreUnavailable
from adapters_registry.manifest import AdapterManifest

logger = logging.getLogger(__name__)


class AdapterCatalog:
    def __init__(self, store, ttl_s: float = 1.0, negative_ttl_s: float = 0.5, stale_wait_s: float = 1.0,
                 refresh_after_s: float | None = None):
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.stale_wait_s = stale_wait_s  # how long a request with a known manifest waits for the store
        self.refresh_after_s = ttl_s / 2 if refresh_after_s is None else refresh_after_s
        self._entries: dict[str, tuple[float, AdapterManifest | None]] = {}
        self._reads: dict[str, asyncio.Task[AdapterManifest]] = {}  # one store read per id at a time
        self._dumps: dict[str, tuple[AdapterManifest, dict]] = {}
        self._list: tuple[float, list[AdapterManifest]] | None = None

    async def get(self, adapter_id: str) -> AdapterManifest:
        """Latest manifest of ``adapter_id``; raises AdapterNotFound (404)."""
        now = time.monotonic()
        hit = self._entries.get(adapter_id)
        known = hit[1] if hit is not None else None
        if hit is not None:
            at, manifest = hit
            if manifest is not None and now - at < self.ttl_s:
                if now - at >= self.refresh_after_s:
                    self._start_read(adapter_id)  # in the background: this request does not wait
                return manifest
            if manifest is None and now - at < self.negative_ttl_s:
                raise AdapterNotFound(f"adapter {adapter_id!r} does not exist")
        read = self._start_read(adapter_id)
        try:
            return await asyncio.wait_for(asyncio.shield(read), self.stale_wait_s if known else None)
        except (StoreUnavailable, asyncio.TimeoutError) as exc:
            if known is None:
                raise
            logger.warning("store slow or unavailable, serving the last known manifest of %s: %r", adapter_id, exc)
            return known

    def _start_read(self, adapter_id: str) -> asyncio.Task[AdapterManifest]:
        read = self._reads.get(adapter_id)
        if read is None:
            read = self._reads[adapter_id] = asyncio.ensure_future(self._read(adapter_id))
            read.add_done_callback(lambda t: self._read_done(adapter_id, t))
        return read

    def _read_done(self, adapter_id: str, read: asyncio.Task) -> None:
        self._reads.pop(adapter_id, None)
        if not read.cancelled() and (exc := read.exception()) is not None and not isinstance(exc, AdapterNotFound):
            logger.info("store read of adapter %r failed: %r", adapter_id, exc)  # the entry is kept

    async def _read(self, adapter_id: str) -> AdapterManifest:
        started = time.monotonic()  # the entry is as fresh as the read's start
        try:
            manifest = await asyncio.to_thread(self.store.get, adapter_id)
        except AdapterNotFound:
            self._entries[adapter_id] = (started, None)
            raise
        self._entries[adapter_id] = (started, manifest)
        return manifest

    def dump(self, manifest: AdapterManifest) -> dict:
        """``manifest.model_dump(mode="json")``, made once per manifest object (never mutate it)."""
        hit = self._dumps.get(manifest.adapter_id)
        if hit is not None and hit[0] is manifest:
            return hit[1]
        dump = manifest.model_dump(mode="json")
        self._dumps[manifest.adapter_id] = (manifest, dump)
        return dump

    async def list(self) -> list[AdapterManifest]:
        """Latest manifest of every adapter (cached for ``ttl_s``)."""
        now = time.monotonic()
        if self._list is None or now - self._list[0] >= self.ttl_s:
            self._list = (time.monotonic(), await asyncio.to_thread(self.store.list))
        return self._list[1]

    def invalidate(self, adapter_id: str | None = None) -> None:
        """Forget cached entries (after an admin push or delete through this gateway)."""
        if adapter_id is None:
            self._entries.clear()
            self._dumps.clear()
        else:
            self._entries.pop(adapter_id, None)
            self._dumps.pop(adapter_id, None)
        self._list = None
