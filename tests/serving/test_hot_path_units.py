"""The serving hot path's pure parts: the engine's manifest cache, the catalog's background
refresh, the tenants watcher. Real stores and files; no timing asserted."""

from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import ValidationError

from adapters_registry.errors import AdapterNotFound
from app.engine.manifests import ManifestCache
from app.gateway.catalog import AdapterCatalog
from app.gateway.tenants import TenantDirectory, TenantsFile
from tests.helpers.aio import asynctest


def _manifest_dump(version: int = 1, **over) -> dict:
    dump = {
        "adapter_id": "a1", "version": version, "owner_tenant": "acme",
        "base_model": {"name": "m", "architecture": "Qwen3MoeForCausalLM"},
        "rank": 8, "lora_alpha": 16.0, "has_expert_lora": False, "layout": "none",
        "files": [{"name": "adapter_model.safetensors", "sha256": "0" * 64, "size": 1}],
        "created_at": "2026-12-01T00:00:00Z",
    }
    return {**dump, **over}


def test_manifest_cache_validates_once_per_dump_and_again_when_the_dump_differs():
    cache = ManifestCache(max_entries=2)
    assert cache.get(None) is None
    first = cache.get(_manifest_dump())
    assert first.adapter_id == "a1" and first.version == 1
    assert cache.get(_manifest_dump()) is first  # an equal dump (a fresh copy, as from Ray)
    other = cache.get(_manifest_dump(rank=4))  # same key, other content: validated afresh
    assert other is not first and other.rank == 4
    cache.get(_manifest_dump(2))
    cache.get(_manifest_dump(3))
    assert len(cache) == 2  # bounded
    with pytest.raises(ValidationError):
        cache.get(_manifest_dump(4, rank=0))


class CountingStore:
    """A real local store, reads counted."""

    def __init__(self, inner) -> None:
        self.inner, self.reads = inner, 0

    def get(self, adapter_id):
        self.reads += 1
        return self.inner.get(adapter_id)

    def list(self):
        return self.inner.list()


class MarkedCountingStore(CountingStore):
    """A real local store with its change marker, reads and marker reads counted."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.marker_reads = 0

    def change_marker(self):
        self.marker_reads += 1
        return self.inner.change_marker()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _reads_done(catalog) -> None:
    for _ in range(500):
        if not catalog._reads:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("store reads still running")


@pytest.fixture
def local_store(tmp_path, embedded_model_dir):
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter

    store = open_store((tmp_path / "store").as_uri())
    folder = tmp_path / "peft"
    build_peft_adapter(embedded_model_dir, folder, "attention", 8, 7)
    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    store.publish(folder, "hot-a", "acme", base)
    return store, folder, base


@asynctest
async def test_catalog_refreshes_in_the_background_within_the_ttl(local_store):
    store, folder, base = local_store
    counting = CountingStore(store)
    catalog = AdapterCatalog(counting, ttl_s=60.0, refresh_after_s=0.0)
    first = await catalog.get("hot-a")
    assert counting.reads == 1 and first.version == 1
    store.publish(folder, "hot-a", "acme", base)  # version 2
    served = await catalog.get("hot-a")  # within the TTL: the cached one at once, a refresh started
    assert served is first
    for _ in range(200):
        if not catalog._reads:
            break
        await asyncio.sleep(0.01)
    assert (await catalog.get("hot-a")).version == 2  # the background refresh brought the new version
    assert catalog.dump(first) is catalog.dump(first) and catalog.dump(first)["version"] == 1
    with pytest.raises(AdapterNotFound):
        await catalog.get("no-such-adapter")


@asynctest
async def test_catalog_keeps_entries_past_the_ttl_while_the_change_marker_holds(local_store):
    """A rarely called adapter: past the TTL, but the marker did not move, so no request waits for
    a store read; a push moves the marker and the used entry is re-read in the background."""
    store, folder, base = local_store
    counting, clock = MarkedCountingStore(store), FakeClock()
    catalog = AdapterCatalog(counting, ttl_s=1.0, refresh_after_s=3600.0, reread_after_s=100.0,
                             keep_fresh_s=1000.0, clock=clock)
    first = await catalog.get("hot-a")
    assert counting.reads == 1
    await catalog.refresh_once()  # the marker seen for the first time: the used entry re-read
    await _reads_done(catalog)
    assert counting.reads == 2 and counting.marker_reads == 1
    for _ in range(3):  # 19 s between calls, as one of 8 adapters taking turns at c1
        clock.now += 19.0
        await catalog.refresh_once()  # (the background task runs it every refresh_after_s)
        assert (await catalog.get("hot-a")).version == first.version
    assert counting.reads == 2  # no request read the store
    store.publish(folder, "hot-a", "acme", base)  # version 2: the marker moves
    clock.now += 0.5
    assert (await catalog.get("hot-a")).version == 1  # within the TTL of the last confirmation
    await catalog.refresh_once()
    await _reads_done(catalog)
    assert (await catalog.get("hot-a")).version == 2 and counting.reads == 3
    clock.now += 101.0  # the entry's read is older than reread_after_s: re-read once in the background
    await catalog.refresh_once()
    await _reads_done(catalog)
    assert counting.reads == 4 and (await catalog.get("hot-a")).version == 2


@asynctest
async def test_catalog_entry_not_confirmed_by_the_marker_expires(local_store):
    """An entry read before the marker run it would be extended by is not extended: past its TTL
    the request reads the store again (and sees the new version)."""
    store, folder, base = local_store
    counting, clock = MarkedCountingStore(store), FakeClock()
    catalog = AdapterCatalog(counting, ttl_s=1.0, refresh_after_s=3600.0, keep_fresh_s=5.0, clock=clock)
    await catalog.refresh_once()  # marker M1 seen at t0
    await catalog.get("hot-a")  # read at t0
    clock.now += 10.0  # no longer hot (keep_fresh_s 5)
    store.publish(folder, "hot-a", "acme", base)
    await catalog.refresh_once()  # marker M2: cold entries are not re-read, and not extended
    await _reads_done(catalog)
    assert counting.reads == 1
    clock.now += 0.1
    await catalog.refresh_once()  # M2 again: the entry was read before M2 was first seen
    assert (await catalog.get("hot-a")).version == 2 and counting.reads == 2


@asynctest
async def test_catalog_past_its_ttl_reads_before_answering(local_store):
    store, folder, base = local_store
    catalog = AdapterCatalog(store, ttl_s=0.0)
    assert (await catalog.get("hot-a")).version == 1
    store.publish(folder, "hot-a", "acme", base)
    assert (await catalog.get("hot-a")).version == 2


@asynctest
async def test_tenants_watcher_reloads_off_the_request_path_and_new_keys_work_at_once(tmp_path):
    path = tmp_path / "tenants.yaml"
    doc = TenantsFile()
    old = doc.add_key("acme")
    doc.write(path)
    directory = TenantDirectory(path, watch_interval_s=0.01)
    assert directory.authenticate(f"Bearer {old}").name == "acme"  # starts the watcher
    assert directory._watcher is not None
    doc = TenantsFile.read(path)
    new = doc.add_key("globex")
    doc.write(path)
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    assert directory.authenticate(f"Bearer {new}").name == "globex"  # unknown key: checked at once
    doc.tenants = [t for t in doc.tenants if t.name != "acme"]  # acme's key revoked
    doc.write(path)
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 10))
    for _ in range(300):
        try:
            directory.authenticate(f"Bearer {old}")
        except Exception:
            break
        await asyncio.sleep(0.01)
    from app.errors import Unauthorized

    with pytest.raises(Unauthorized):
        directory.authenticate(f"Bearer {old}")  # the watcher saw the change
    directory.close()
