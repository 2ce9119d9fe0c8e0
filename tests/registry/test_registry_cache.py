"""Disk cache: content-addressed folders, single flight, byte-bounded LRU, pins, faults leave it clean."""

from __future__ import annotations

import asyncio
import threading

import pytest

from adapters_registry.cache import AdapterCache
from adapters_registry.errors import (
    AdapterInvalid,
    AdapterNotFound,
    CacheFull,
    StoreUnavailable,
)
from adapters_registry.manifest import WEIGHTS_NAME
from adapters_registry.stores import open_store
from adapters_registry.stores.local import LocalAdapterStore
from adapters_registry.verify import sha256_file
from tests.helpers.aio import asynctest
from tests.helpers.assets import publish_synthetic


def publish_n(store, base, tmp_path, n, r=4):
    return publish_synthetic(store, base, tmp_path, n, r=r, first_seed=100)


def cache_files(cache: AdapterCache) -> set[str]:
    return {str(p.relative_to(cache.root)) for p in cache.root.rglob("*") if p.is_file()}


class CountingStore(LocalAdapterStore):
    """The real local store, counting downloads and optionally failing or stalling them."""

    def __init__(self, uri, fail_times=0, gate: threading.Event | None = None):
        super().__init__(uri)
        self.downloads = 0
        self.fail_times = fail_times
        self.gate = gate

    def download(self, manifest, dest_dir):
        self.downloads += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_times > 0:
            self.fail_times -= 1
            raise StoreUnavailable("injected: store down")
        return super().download(manifest, dest_dir)


@asynctest
async def test_miss_then_hit_verified_content(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    cache = AdapterCache(tmp_path / "cache", 10**9)
    p = await cache.ensure_local(store, m)
    assert p.name == m.content_digest
    assert sha256_file(p / WEIGHTS_NAME) == (m.file(WEIGHTS_NAME).sha256, m.file(WEIGHTS_NAME).size)
    assert await cache.ensure_local(store, m) == p
    assert (cache.stats["misses"], cache.stats["hits"], cache.stats["downloads"]) == (1, 1, 1)


@asynctest
async def test_concurrent_misses_share_one_download(base, tmp_path):
    gate = threading.Event()
    store = CountingStore((tmp_path / "store").as_uri(), gate=gate)
    (m,) = publish_n(store, base, tmp_path, 1)
    cache = AdapterCache(tmp_path / "cache", 10**9)
    tasks = [asyncio.create_task(cache.ensure_local(store, m)) for _ in range(8)]
    await asyncio.sleep(0.05)
    gate.set()
    paths = await asyncio.gather(*tasks)
    assert len(set(paths)) == 1 and store.downloads == 1


@asynctest
async def test_lru_eviction_respects_bound_and_pins(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 4)
    size = ms[0].total_bytes
    cache = AdapterCache(tmp_path / "cache", int(size * 2.5))
    await cache.ensure_local(store, ms[0], pin=True)
    await cache.ensure_local(store, ms[1])
    await cache.ensure_local(store, ms[2])  # evicts ms[1] (LRU, unpinned), not the pinned ms[0]
    assert cache.contains(ms[0]) and not cache.contains(ms[1]) and cache.contains(ms[2])
    assert cache.used_bytes <= cache.max_bytes
    assert not (cache.objects / ms[1].content_digest).exists()
    await cache.ensure_local(store, ms[2], pin=True)
    with pytest.raises(CacheFull, match="pinned by adapters the engine holds") as ei:
        await cache.ensure_local(store, ms[3])
    assert ei.value.http_status == 507
    cache.unpin(ms[0])
    await cache.ensure_local(store, ms[3])
    assert not cache.contains(ms[0]) and cache.contains(ms[2])
    assert not any(p.name.startswith("trash") for p in cache.tmp.iterdir())


@asynctest
async def test_adapter_larger_than_cache(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    cache = AdapterCache(tmp_path / "cache", m.total_bytes - 1)
    with pytest.raises(CacheFull, match="larger than the whole cache bound"):
        await cache.ensure_local(store, m)
    assert cache_files(cache) == set()


@asynctest
async def test_corrupt_object_clear_error_cache_clean(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    f = store.root / m.adapter_id / str(m.version) / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    cache = AdapterCache(tmp_path / "cache", 10**9, backoff_s=0.01)
    with pytest.raises(AdapterInvalid, match="corrupt.*sha256 mismatch.*re-push") as ei:
        await cache.ensure_local(store, m)
    assert ei.value.http_status == 422
    assert cache_files(cache) == set() and not cache.contains(m)


@asynctest
async def test_truncated_object(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    f = store.root / m.adapter_id / str(m.version) / WEIGHTS_NAME
    f.write_bytes(f.read_bytes()[:-1000])
    cache = AdapterCache(tmp_path / "cache", 10**9, backoff_s=0.01)
    with pytest.raises(AdapterInvalid, match="truncated"):
        await cache.ensure_local(store, m)
    assert cache_files(cache) == set()


@asynctest
async def test_deleted_in_store_gives_404_and_clean_cache(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    store.delete(m.adapter_id)
    cache = AdapterCache(tmp_path / "cache", 10**9, backoff_s=0.01)
    with pytest.raises(AdapterNotFound, match="gone") as ei:
        await cache.ensure_local(store, m)
    assert ei.value.http_status == 404
    assert cache_files(cache) == set()


@asynctest
async def test_transient_failures_retried_then_503(base, tmp_path):
    store = CountingStore((tmp_path / "store").as_uri(), fail_times=2)
    (m,) = publish_n(store, base, tmp_path, 1)
    cache = AdapterCache(tmp_path / "cache", 10**9, attempts=3, backoff_s=0.01)
    assert (await cache.ensure_local(store, m)).is_dir()
    assert store.downloads == 3
    store2 = CountingStore(store.uri, fail_times=5)
    cache2 = AdapterCache(tmp_path / "cache2", 10**9, attempts=2, backoff_s=0.01)
    with pytest.raises(StoreUnavailable) as ei:
        await cache2.ensure_local(store2, m)
    assert ei.value.http_status == 503 and ei.value.retry_after_s
    assert cache_files(cache2) == set()


@asynctest
async def test_restart_rehashes_and_drops_tampered_entries(store, base, tmp_path):
    m0, m1 = publish_n(store, base, tmp_path, 2)
    cache = AdapterCache(tmp_path / "cache", 10**9)
    p0 = await cache.ensure_local(store, m0)
    p1 = await cache.ensure_local(store, m1)
    (p1 / WEIGHTS_NAME).write_bytes(b"garbage")
    (cache.tmp / "half-written").write_bytes(b"x")
    restarted = AdapterCache(tmp_path / "cache", 10**9)
    assert not (restarted.tmp / "half-written").exists()
    assert await restarted.ensure_local(store, m0) == p0
    assert await restarted.ensure_local(store, m1) == p1
    assert sha256_file(p1 / WEIGHTS_NAME)[0] == m1.file(WEIGHTS_NAME).sha256
    assert restarted.stats["downloads"] == 1  # m0 re-verified in place, m1 fetched again


@asynctest
async def test_evict_skips_pinned(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    cache = AdapterCache(tmp_path / "cache", 10**9)
    await cache.ensure_local(store, m, pin=True)
    assert not await cache.evict(m)
    await cache.release(m)
    assert await cache.evict(m)
    assert cache_files(cache) == set()


@asynctest
async def test_large_files_are_verified_part_by_part(base, tmp_path, monkeypatch):
    import adapters_registry.stores.base as store_mod

    monkeypatch.setattr(store_mod, "PART_BYTES", 8 * 1024)
    store = open_store((tmp_path / "store").as_uri())
    (m,) = publish_n(store, base, tmp_path, 1, r=16)
    w = m.file(WEIGHTS_NAME)
    assert w.part_bytes == 8 * 1024 and len(w.part_sha256) == -(-w.size // w.part_bytes) > 4
    cache = AdapterCache(tmp_path / "cache", 10**9, backoff_s=0.01)
    p = await cache.ensure_local(store, m)
    assert sha256_file(p / WEIGHTS_NAME) == (w.sha256, w.size)
    f = store.root / m.adapter_id / str(m.version) / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[3 * w.part_bytes + 17] ^= 1
    f.write_bytes(bytes(data))
    await cache.evict(m)
    with pytest.raises(AdapterInvalid, match="sha256 mismatch in part 3 of"):
        await cache.ensure_local(store, m)
    assert not any(cache.objects.iterdir())
