"""The gateway's catalog during a store outage: known adapters keep resolving, unknown ones 503."""

from __future__ import annotations

import threading
import time

import pytest

from adapters_registry.errors import AdapterNotFound, StoreUnavailable
from app.gateway.catalog import AdapterCatalog
from tests.helpers.aio import asynctest


class FlakyStore:
    """A store double: ``get`` answers a fixed manifest, or fails, or blocks until released."""

    def __init__(self):
        self.mode = "up"
        self.release = threading.Event()
        self.reads = 0

    def get(self, adapter_id):
        self.reads += 1
        if self.mode == "down":
            raise StoreUnavailable("injected: store down")
        if self.mode == "stalled":
            self.release.wait(10)
        if adapter_id != "known":
            raise AdapterNotFound(adapter_id)
        return f"manifest-of-{adapter_id}-read-{self.reads}"


@asynctest
async def test_known_adapters_resolve_while_the_store_is_down_or_stalled():
    store = FlakyStore()
    catalog = AdapterCatalog(store, ttl_s=0.0, stale_wait_s=0.2)
    first = await catalog.get("known")
    store.mode = "down"
    assert await catalog.get("known") == first
    with pytest.raises(StoreUnavailable):
        await catalog.get("never-read")
    store.mode = "stalled"
    reads_before = store.reads
    t0 = time.monotonic()
    results = [await catalog.get("known") for _ in range(3)]
    assert results == [first] * 3 and time.monotonic() - t0 < 2.0  # nobody waits out the stall
    assert store.reads - reads_before == 1  # one read waits on the store, the rest were served
    store.release.set()
    store.mode = "up"
    assert await catalog.get("known") != first  # the store is back: a fresh read
    with pytest.raises(AdapterNotFound):
        await catalog.get("unknown")
