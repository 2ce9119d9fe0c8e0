"""The gateway's view of the adapter store: adapter id → latest manifest, with a short TTL.

Store reads are blocking (boto3 / filesystem) and run in a worker thread. A hit younger than
``ttl_s`` is served from memory, so a freshly pushed adapter or version is callable within
``ttl_s``. The read that keeps a used entry fresh is off the request path: a hit older than
``refresh_after_s`` (half the TTL by default) is served at once and starts one background
refresh of that id (stale-while-revalidate within the TTL), so under steady traffic no request
waits for the store. Only a miss, or an entry past ``ttl_s`` (an adapter not called for that
long), reads the store before answering. Unknown ids are remembered for ``negative_ttl_s``.
Each manifest's JSON dump (what the engine receives) is made once per manifest, not per request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from adapters_registry.errors import AdapterNotFound
from adapters_registry.manifest import AdapterManifest

logger = logging.getLogger(__name__)


class AdapterCatalog:
    def __init__(self, store, ttl_s: float = 1.0, negative_ttl_s: float = 0.5, refresh_after_s: float | None = None):
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.refresh_after_s = ttl_s / 2 if refresh_after_s is None else refresh_after_s
        self._entries: dict[str, tuple[float, AdapterManifest | None]] = {}
        self._dumps: dict[str, tuple[AdapterManifest, dict]] = {}
        self._refreshing: dict[str, asyncio.Task] = {}
        self._list: tuple[float, list[AdapterManifest]] | None = None

    async def get(self, adapter_id: str) -> AdapterManifest:
        """Latest manifest of ``adapter_id``; raises AdapterNotFound (404)."""
        now = time.monotonic()
        hit = self._entries.get(adapter_id)
        if hit is not None:
            at, manifest = hit
            if manifest is not None and now - at < self.ttl_s:
                if now - at >= self.refresh_after_s:
                    self._refresh_soon(adapter_id)
                return manifest
            if manifest is None and now - at < self.negative_ttl_s:
                raise AdapterNotFound(f"adapter {adapter_id!r} does not exist")
        return await self._read(adapter_id)

    async def _read(self, adapter_id: str) -> AdapterManifest:
        started = time.monotonic()  # the entry is as fresh as the read's start
        try:
            manifest = await asyncio.to_thread(self.store.get, adapter_id)
        except AdapterNotFound:
            self._entries[adapter_id] = (started, None)
            raise
        self._entries[adapter_id] = (started, manifest)
        return manifest

    def _refresh_soon(self, adapter_id: str) -> None:
        """One background read of ``adapter_id`` at a time; its errors are logged, the entry kept."""
        if adapter_id in self._refreshing:
            return

        async def refresh() -> None:
            try:
                await self._read(adapter_id)
            except AdapterNotFound:
                pass  # remembered as unknown by _read
            except Exception as exc:  # noqa: BLE001 - the next request past the TTL reads again
                logger.warning("background refresh of adapter %r failed: %s", adapter_id, exc)
            finally:
                self._refreshing.pop(adapter_id, None)

        self._refreshing[adapter_id] = asyncio.ensure_future(refresh())

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
