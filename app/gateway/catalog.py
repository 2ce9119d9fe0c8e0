"""The gateway's view of the adapter store: adapter id → latest manifest, with a short TTL.

Store reads are blocking (boto3 / filesystem) and run in a worker thread. A hit younger than
``ttl_s`` is served from memory; a miss (or an expired entry) reads the store, so a freshly pushed
adapter or version is callable within ``ttl_s``. Unknown ids are remembered for ``negative_ttl_s``.
"""

from __future__ import annotations

import asyncio
import time

from adapters_registry.errors import AdapterNotFound
from adapters_registry.manifest import AdapterManifest


class AdapterCatalog:
    def __init__(self, store, ttl_s: float = 1.0, negative_ttl_s: float = 0.5):
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._entries: dict[str, tuple[float, AdapterManifest | None]] = {}
        self._list: tuple[float, list[AdapterManifest]] | None = None

    async def get(self, adapter_id: str) -> AdapterManifest:
        """Latest manifest of ``adapter_id``; raises AdapterNotFound (404)."""
        now = time.monotonic()
        hit = self._entries.get(adapter_id)
        if hit is not None:
            at, manifest = hit
            if manifest is not None and now - at < self.ttl_s:
                return manifest
            if manifest is None and now - at < self.negative_ttl_s:
                raise AdapterNotFound(f"adapter {adapter_id!r} does not exist")
        try:
            manifest = await asyncio.to_thread(self.store.get, adapter_id)
        except AdapterNotFound:
            self._entries[adapter_id] = (time.monotonic(), None)
            raise
        self._entries[adapter_id] = (time.monotonic(), manifest)
        return manifest

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
        else:
            self._entries.pop(adapter_id, None)
        self._list = None
