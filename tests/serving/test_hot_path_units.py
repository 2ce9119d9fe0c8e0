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
