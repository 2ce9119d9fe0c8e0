"""The gateway's view of the adapter store: adapter id → latest manifest, with a short TTL.

Store reads are blocking (boto3 / filesystem) and run in a worker thread, one per id at a time.
A hit younger than ``ttl_s`` is served from memory, so a freshly pushed adapter or version is
callable within ``ttl_s`` of its push. A miss, or an entry past ``ttl_s``, reads the store before
answering; unknown ids are remembered for ``negative_ttl_s``.

No request waits for the store while its adapter stays known, however rarely it is called: every
``refresh_after_s`` (half the TTL by default) a background task reads the store's change marker
(``AdapterStore.change_marker``, rewritten after every publish and delete). While it is unchanged
since an entry was read, nothing that entry could show has changed, so the entry stays fresh; one
small read per interval keeps every entry, whatever their number. When the marker changes, the
entries used in the last ``keep_fresh_s`` are re-read in the background and the rest age out. An
entry is also re-read in the background once its read is ``reread_after_s`` old, which bounds
staleness if a marker write failed. Stores without a marker (nothing published since it was
introduced): a hit older than ``refresh_after_s`` is served at once and starts a background read
of that id (stale-while-revalidate within the TTL).

While the store is unavailable or slower than ``stale_wait_s``, the last manifest read is served
(logged), so adapters keep being served during a store outage; only ids never read answer 503.
Each manifest's JSON dump (what the engine receives) is made once per manifest, not per request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from adapters_registry.errors import AdapterNotFound, StoreUnavailable
from adapters_registry.manifest import AdapterManifest

logger = logging.getLogger(__name__)


class AdapterCatalog:
    """Entries are ``id -> (fresh_at, manifest or None)``: ``fresh_at`` is the monotonic time as of
    which the manifest is known to be the latest (a read's start, or a later unchanged marker)."""

    def __init__(self, store, ttl_s: float = 1.0, negative_ttl_s: float = 0.5, stale_wait_s: float = 1.0,
                 refresh_after_s: float | None = None, keep_fresh_s: float = 60.0, reread_after_s: float = 30.0,
                 clock=time.monotonic):
        self.store = store
        self.clock = clock
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.stale_wait_s = stale_wait_s  # how long a request with a known manifest waits for the store
        self.refresh_after_s = ttl_s / 2 if refresh_after_s is None else refresh_after_s
        self.keep_fresh_s = keep_fresh_s
        self.reread_after_s = reread_after_s
        self._entries: dict[str, tuple[float, AdapterManifest | None]] = {}
        self._read_at: dict[str, float] = {}  # id -> start of the store read its entry came from
        self._used_at: dict[str, float] = {}
        self._reads: dict[str, asyncio.Task[AdapterManifest]] = {}  # one store read per id at a time
        self._dumps: dict[str, tuple[AdapterManifest, dict]] = {}
        self._list: tuple[float, list[AdapterManifest]] | None = None
        self._marker: str | None = None  # the change marker last read
        self._marker_since = 0.0  # start of the first read that saw it
        self._has_marker = callable(getattr(store, "change_marker", None))
        self._refresher: asyncio.Task | None = None

    async def get(self, adapter_id: str) -> AdapterManifest:
        """Latest manifest of ``adapter_id``; raises AdapterNotFound (404)."""
        now = self.clock()
        self._used_at[adapter_id] = now
        if self._has_marker and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.ensure_future(self._refresh_forever())
        hit = self._entries.get(adapter_id)
        known = hit[1] if hit is not None else None
        if hit is not None:
            at, manifest = hit
            if manifest is not None and now - at < self.ttl_s:
                if self._marker is None and now - at >= self.refresh_after_s:
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
        started = self.clock()  # the entry is as fresh as the read's start
        try:
            manifest = await asyncio.to_thread(self.store.get, adapter_id)
        except AdapterNotFound:
            self._entries[adapter_id] = (started, None)
            raise
        self._entries[adapter_id] = (started, manifest)
        self._read_at[adapter_id] = started
        return manifest

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_after_s)
            try:
                await self.refresh_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is down: entries age out, outage rules apply
                logger.debug("catalog refresh failed: %r", exc)

    async def refresh_once(self) -> None:
        """One read of the store's change marker; see the module doc."""
        started = self.clock()
        marker = await asyncio.to_thread(self.store.change_marker)
        hot = [i for i, used in self._used_at.items() if started - used < self.keep_fresh_s]
        for i in [i for i in self._used_at if i not in hot]:
            self._used_at.pop(i, None)
        if marker is not None and marker == self._marker:
            for i, (at, manifest) in list(self._entries.items()):
                if manifest is not None and at >= self._marker_since:
                    self._entries[i] = (started, manifest)
        else:
            self._marker, self._marker_since = marker, started
            for i in hot:
                if self._entries.get(i, (0.0, None))[1] is not None:
                    self._start_read(i)
        for i in hot:
            if i in self._entries and started - self._read_at.get(i, started) >= self.reread_after_s:
                self._start_read(i)

    def close(self) -> None:
        """Stops the background refresh (the gateway replica is shutting down)."""
        if self._refresher is not None:
            self._refresher.cancel()

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
        now = self.clock()
        if self._list is None or now - self._list[0] >= self.ttl_s:
            self._list = (self.clock(), await asyncio.to_thread(self.store.list))
        return self._list[1]

    def invalidate(self, adapter_id: str | None = None) -> None:
        """Forget cached entries (after an admin push or delete through this gateway)."""
        if adapter_id is None:
            self._entries.clear()
            self._dumps.clear()
            self._read_at.clear()
        else:
            self._entries.pop(adapter_id, None)
            self._dumps.pop(adapter_id, None)
            self._read_at.pop(adapter_id, None)
        self._list = None
