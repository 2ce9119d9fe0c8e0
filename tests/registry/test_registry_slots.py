"""Engine residency table: one LRU, pins while in use, remove_lora before file deletion.

The engine is a test double of the two vLLM AsyncLLM methods that records calls and checks the
invariants a real engine relies on; store, cache and LoRARequest are the real ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from adapters_registry.cache import AdapterCache
from adapters_registry.errors import (
    AdapterConflict,
    AdapterInvalid,
    AdapterLoadFailed,
    CacheFull,
    SlotsExhausted,
    SlotsTooSmall,
)
from adapters_registry.manifest import MANIFEST_NAME, AdapterManifest
from adapters_registry.slots import AdapterSlots, engine_lora_name
from benchmarks.synthetic_adapters import synthetic_adapter
from tests.helpers.aio import asynctest
from tests.helpers.assets import publish_synthetic
from tests.helpers.engines import RecordingEngine
from tests.helpers.registry_events import EventLog


def publish_n(store, base, tmp_path, n) -> list[AdapterManifest]:
    return publish_synthetic(store, base, tmp_path, n)


def make(tmp_path, capacity, cache_bytes=10**9, **kw):
    engine = RecordingEngine(capacity)
    cache = AdapterCache(tmp_path / "cache", cache_bytes)
    return engine, cache, AdapterSlots(engine, cache, capacity, **kw)


@asynctest
async def test_first_use_registers_then_hits(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    engine, cache, slots = make(tmp_path, 2)
    async with slots.use(store, m) as req:
        assert req.lora_name == engine_lora_name(m) and req.lora_int_id >= 1
        assert (Path(req.lora_path) / MANIFEST_NAME).is_file()
        assert slots.snapshot()[0]["active_requests"] == 1
    async with slots.use(store, m) as req2:
        assert req2.lora_int_id == req.lora_int_id
    assert [c[0] for c in engine.calls] == ["add"]
    assert slots.resident() == ["ad0"] and slots.stats["hits"] == 1


@asynctest
async def test_lru_eviction_removes_from_engine_before_files(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 3)
    size = ms[0].total_bytes
    engine, cache, slots = make(tmp_path, 2, cache_bytes=int(size * 2.5))
    for m in ms[:2]:
        async with slots.use(store, m):
            pass
    async with slots.use(store, ms[0]):  # ms[0] most recent: ms[1] is the LRU victim
        pass
    async with slots.use(store, ms[2]):
        assert engine.names() == {"ad0@v1", "ad2@v1"}
        # The cache had to make room, and could only take ms[1] after remove_lora released it.
        assert not cache.contains(ms[1]) and cache.contains(ms[0])
    removed = [c for c in engine.calls if c[0] == "remove"]
    assert len(removed) == 1
    assert slots.resident() == ["ad0", "ad2"]
    assert set(slots.resident()) == {n.split("@")[0] for n in engine.names()}


@asynctest
async def test_all_slots_busy_gives_503_with_retry_hint(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 3)
    engine, cache, slots = make(tmp_path, 2, acquire_timeout_s=0.2)
    async with slots.use(store, ms[0]), slots.use(store, ms[1]):
        with pytest.raises(SlotsExhausted, match="all 2 adapter slots") as ei:
            async with slots.use(store, ms[2]):
                pass
        assert ei.value.http_status == 503 and ei.value.retry_after_s
    assert engine.names() == {"ad0@v1", "ad1@v1"}


@asynctest
async def test_waits_for_a_slot_to_free(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 2)
    engine, cache, slots = make(tmp_path, 1, acquire_timeout_s=5)

    async def hold():
        async with slots.use(store, ms[0]):
            await asyncio.sleep(0.1)

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0.02)
    async with slots.use(store, ms[1]) as req:
        assert req.lora_name == engine_lora_name(ms[1])
    await holder
    assert engine.names() == {"ad1@v1"}


def _publish_big(store, base, tmp_path, r: int = 16) -> AdapterManifest:
    return store.publish(synthetic_adapter(tmp_path / "big-src", base, r=r, seed=99), "big", "acme", base)


@asynctest
async def test_a_byte_budget_evicts_as_many_idle_adapters_as_a_larger_one_needs(store, base, tmp_path):
    small = publish_n(store, base, tmp_path, 3)
    big = _publish_big(store, base, tmp_path)
    size = small[0].total_bytes
    assert big.total_bytes > 3 * size
    budget = big.total_bytes + size // 2  # three small ones fit (rows to spare), the big one only alone
    engine, cache, slots = make(tmp_path, 8, capacity_bytes=budget)
    for m in small:
        async with slots.use(store, m):
            assert slots.registered_bytes <= budget
    assert engine.names() == {"ad0@v1", "ad1@v1", "ad2@v1"}
    async with slots.use(store, big):
        assert engine.names() == {"big@v1"} and slots.registered_bytes == big.total_bytes
        assert [row["bytes"] for row in slots.snapshot()] == [big.total_bytes]
    assert [c[0] for c in engine.calls].count("remove") == 3
    async with slots.use(store, small[0]):  # and back: the big one goes
        assert engine.names() == {"ad0@v1"}
    # what the router is told: rows to spare, but bytes for only as many adapters of this size
    assert slots.free_slots == (budget - size) // size < 8 - 1


@asynctest
async def test_a_byte_budget_never_evicts_adapters_in_use(store, base, tmp_path):
    small = publish_n(store, base, tmp_path, 2)
    big = _publish_big(store, base, tmp_path)
    engine, cache, slots = make(tmp_path, 8, capacity_bytes=big.total_bytes + small[0].total_bytes // 2,
                                acquire_timeout_s=0.2)
    async with slots.use(store, small[0]):
        with pytest.raises(SlotsExhausted, match="byte budget for registered adapters") as ei:
            async with slots.use(store, big):
                pass
        assert ei.value.http_status == 503 and "ad0" in str(ei.value)
        assert engine.names() == {"ad0@v1"}
    async with slots.use(store, big):  # idle now: evicted
        assert engine.names() == {"big@v1"}


@asynctest
async def test_an_adapter_larger_than_the_whole_byte_budget_is_refused_and_evicts_nothing(store, base, tmp_path):
    small = publish_n(store, base, tmp_path, 1)
    big = _publish_big(store, base, tmp_path)
    engine, cache, slots = make(tmp_path, 8, capacity_bytes=big.total_bytes - 1)
    async with slots.use(store, small[0]):
        pass
    with pytest.raises(SlotsTooSmall, match="max_cpu_lora_gib") as ei:
        async with slots.use(store, big):
            pass
    assert ei.value.http_status == 507
    assert engine.names() == {"ad0@v1"} and slots.resident() == ["ad0"]
    assert not cache.contains(big)


@asynctest
async def test_operator_pins_hold_at_most_half_of_a_byte_budget(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 3)
    size = ms[0].total_bytes
    engine, cache, slots = make(tmp_path, 8, capacity_bytes=int(3.5 * size))
    await slots.pin(store, ms[0])
    with pytest.raises(AdapterConflict, match="at most half may be pinned"):
        await slots.pin(store, ms[1])
    await slots.pin(store, ms[0])  # already pinned: no change, no refusal
    for m in ms[1:]:  # the unpinned rest of the budget still takes and evicts adapters
        async with slots.use(store, m):
            pass
    assert "ad0@v1" in engine.names() and slots.registered_bytes <= 3.5 * size


@asynctest
async def test_cache_full_of_pinned_adapters_is_a_clear_error(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 3)
    engine, cache, slots = make(tmp_path, 3, cache_bytes=int(ms[0].total_bytes * 2.5))
    for m in ms[:2]:
        async with slots.use(store, m):
            pass
    with pytest.raises(CacheFull):
        async with slots.use(store, ms[2]):
            pass
    assert engine.names() == {"ad0@v1", "ad1@v1"} and len(slots.snapshot()) == 2
    async with slots.use(store, ms[0]):  # the others keep serving
        pass


@asynctest
async def test_engine_refusal_leaves_no_row_and_no_pin(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    engine, cache, slots = make(tmp_path, 2)
    engine.refuse.add("ad0@v1")
    with pytest.raises(AdapterInvalid, match="the engine refused ad0@v1: engine says no"):
        async with slots.use(store, m):
            pass
    assert slots.snapshot() == [] and cache.snapshot()[0]["pins"] == 0
    engine.refuse.clear()
    engine.decline.add("ad0@v1")
    with pytest.raises(AdapterLoadFailed, match="refused to register") as ei:
        async with slots.use(store, m):
            pass
    assert ei.value.http_status == 503 and slots.snapshot() == [] and cache.snapshot()[0]["pins"] == 0


@asynctest
async def test_operator_pin_survives_pressure(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 4)
    engine, cache, slots = make(tmp_path, 3)
    await slots.pin(store, ms[0])
    for m in ms[1:]:
        async with slots.use(store, m):
            pass
    assert "ad0@v1" in engine.names()
    await slots.pin(store, ms[1])
    with pytest.raises(AdapterConflict, match="would leave no evictable slot"):
        await slots.pin(store, ms[3])
    assert slots.unpin("ad0") == 1 and slots.unpin("ad1") == 1
    for m in ms[1:]:
        async with slots.use(store, m):
            pass
    assert "ad0@v1" not in engine.names()


@asynctest
async def test_retire_old_versions(store, base, tmp_path):
    src = synthetic_adapter(tmp_path / "src", base, r=4, seed=9)
    v1 = store.publish(src, "x", "acme", base)
    engine, cache, slots = make(tmp_path, 3)
    async with slots.use(store, v1):
        pass
    v2 = store.publish(synthetic_adapter(tmp_path / "src2", base, r=4, seed=10), "x", "acme", base)
    async with slots.use(store, store.get("x")) as req:
        assert req.lora_name == engine_lora_name(v2)
    assert await slots.retire("x", keep_version=v2.version) == 1
    assert engine.names() == {"x@v2"}


@asynctest
async def test_more_adapters_than_slots_under_concurrency(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 6)
    engine, cache, slots = make(tmp_path, 2, cache_bytes=int(ms[0].total_bytes * 3.5), acquire_timeout_s=30)
    rng = random.Random(0)
    seen: list[tuple[str, str]] = []

    async def request(m: AdapterManifest):
        async with slots.use(store, m) as req:
            # While in use, the adapter is registered, its files are the manifest's, nothing else took its slot.
            assert engine.registered[req.lora_int_id][0] == engine_lora_name(m)
            assert AdapterManifest.model_validate_json((Path(req.lora_path) / MANIFEST_NAME).read_text()) == m
            await asyncio.sleep(rng.random() * 0.01)
            seen.append((engine_lora_name(m), req.lora_name))

    await asyncio.gather(*(request(rng.choice(ms)) for _ in range(60)))
    assert len(seen) == 60 and all(a == b for a, b in seen)
    assert len(engine.registered) <= 2
    assert {r["lora_name"] for r in slots.snapshot()} == engine.names()
    assert slots.stats["evictions"] > 0 and slots.stats["failures"] == 0
    assert cache.used_bytes <= cache.max_bytes


@asynctest
async def test_events_per_tier(store, base, tmp_path):
    """Lookups, loads, evictions, cache bytes and residency reach the observer, per tier."""
    ms = publish_n(store, base, tmp_path, 2)
    log = EventLog()
    engine = RecordingEngine(1)
    cache = AdapterCache(tmp_path / "cache", 10**9, observer=log)
    slots = AdapterSlots(engine, cache, 1, observer=log)
    for m in (ms[0], ms[0], ms[1]):
        async with slots.use(store, m):
            pass
    assert [e[2] for e in log.named("lookup", "engine")] == [False, True, False]
    assert [e[2] for e in log.named("lookup", "disk")] == [False, False]
    assert len(log.named("loaded", "disk")) == 2 and len(log.named("loaded", "engine")) == 2
    assert all(e[2] > 0 for e in log.named("loaded"))
    assert log.named("evicted", "engine") == [("evicted", "engine")] and not log.named("evicted", "disk")
    assert log.named("cache_bytes")[-1] == ("cache_bytes", cache.used_bytes) and cache.used_bytes > 0
    # residency at start and after each change: empty; ad0 loaded; ad0 evicted; ad1 loaded
    assert log.named("residency") == [("residency", (), 1), ("residency", ("ad0",), 1), ("residency", (), 1),
                                      ("residency", ("ad1",), 1)]
    assert not log.named("failed")


@asynctest
async def test_validated_again_before_load_against_this_engine(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)  # rank 4, published with max_lora_rank 64
    engine = RecordingEngine(2)
    strict = AdapterSlots(engine, AdapterCache(tmp_path / "c1", 10**9), 2, base=base, max_lora_rank=2)
    with pytest.raises(AdapterInvalid, match="above this engine's max_lora_rank 2") as ei:
        async with strict.use(store, m):
            pass
    assert ei.value.http_status == 422 and engine.calls == [] and strict.snapshot() == []
    other = base.model_copy(update={"architecture": "OtherForCausalLM"})
    wrong_base = AdapterSlots(engine, AdapterCache(tmp_path / "c2", 10**9), 2, base=other, max_lora_rank=64)
    with pytest.raises(AdapterInvalid, match="this engine serves OtherForCausalLM"):
        async with wrong_base.use(store, m):
            pass
    ok = AdapterSlots(engine, AdapterCache(tmp_path / "c3", 10**9), 2, base=base, max_lora_rank=64)
    async with ok.use(store, m) as req:
        assert req.lora_name == engine_lora_name(m)


@asynctest
async def test_the_router_sees_which_adapters_are_in_use_and_how_many_rows_it_could_take(store, base, tmp_path):
    ms = publish_n(store, base, tmp_path, 3)
    engine, cache, slots = make(tmp_path, 3)
    assert slots.loadable_slots == 3 and slots.active() == []
    async with slots.use(store, ms[0]):
        async with slots.use(store, ms[1]):
            assert slots.active() == ["ad0", "ad1"] and slots.loadable_slots == 1  # one row free
        assert slots.active() == ["ad0"] and slots.loadable_slots == 2  # ad1's row idle: evictable
    slots.pin  # operator pins count as in use for loading
    await slots.pin(store, ms[2])
    assert slots.loadable_slots == 2 and slots.active() == []


class _SlowAddEngine(RecordingEngine):
    """``add_lora`` takes ``add_s``: the load's steps must put that time under add_lora."""

    def __init__(self, capacity: int, add_s: float):
        super().__init__(capacity)
        self.add_s = add_s

    async def add_lora(self, req) -> bool:
        await asyncio.sleep(self.add_s)
        return await super().add_lora(req)


@asynctest
async def test_a_load_records_its_steps_on_the_row_and_a_hit_finds_them_older_than_itself(store, base, tmp_path):
    (m,) = publish_n(store, base, tmp_path, 1)
    engine = _SlowAddEngine(2, add_s=0.2)
    slots = AdapterSlots(engine, AdapterCache(tmp_path / "cache", 10**9), 2)
    t0 = asyncio.get_running_loop().time()
    async with slots.use_slot(store, m) as slot:
        steps = dict(slot.load_steps)
        assert set(steps) == {"disk_s", "checks_s", "add_lora_s"}
        assert 0.2 <= steps["add_lora_s"] < 0.2 + 0.1 and steps["disk_s"] > 0
        assert sum(steps.values()) <= asyncio.get_running_loop().time() - t0
        loaded_at = slot.loaded_at
    arrived = time.monotonic()
    async with slots.use_slot(store, m) as again:
        assert again is slot and again.loaded_at == loaded_at < arrived  # a hit: no load to report
