"""A version number reused with other bytes (the store wiped and re-pushed) reaches the engine
under another name: vLLM 0.24 keys prefix-cache blocks by the LoRA name alone, so a shared name
would serve the old adapter's cached KV blocks to the new one."""

from __future__ import annotations

from adapters_registry.cache import AdapterCache
from adapters_registry.slots import AdapterSlots, engine_lora_name
from adapters_registry.stores import open_store
from benchmarks.synthetic_adapters import synthetic_adapter
from tests.helpers.aio import asynctest
from tests.helpers.engines import RecordingEngine


@asynctest
async def test_reused_version_number_gets_a_new_engine_name(base, tmp_path):
    old_store = open_store((tmp_path / "old").as_uri())
    new_store = open_store((tmp_path / "wiped-and-re-pushed").as_uri())
    old = old_store.publish(synthetic_adapter(tmp_path / "a", base, r=4, seed=1), "x", "acme", base)
    new = new_store.publish(synthetic_adapter(tmp_path / "b", base, r=4, seed=2), "x", "acme", base)
    assert old.lora_name == new.lora_name == "x@v1" and old.content_digest != new.content_digest
    engine = RecordingEngine(2)
    slots = AdapterSlots(engine, AdapterCache(tmp_path / "cache", 10**9), 2)
    async with slots.use(old_store, old) as first:
        pass
    async with slots.use(new_store, new) as second:
        assert [n for n, _ in engine.registered.values()] == [second.lora_name]
    assert first.lora_name == engine_lora_name(old) != second.lora_name == engine_lora_name(new)
    assert first.lora_int_id != second.lora_int_id
    assert [c[0] for c in engine.calls] == ["add", "remove", "add"]
