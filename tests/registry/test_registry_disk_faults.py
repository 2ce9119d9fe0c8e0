"""The disk cache on a real file system that fills up mid-download or turns read-only.

The cache lives on a tmpfs mounted in a child's own mount namespace (``tests.helpers.mount_ns``):
two cold adapters miss at once on a disk with room for one and a half (once, both started and
both died of ENOSPC half-way); another process fills the disk while a download is writing; then
the disk is remounted read-only under a resident adapter. The engine is the recording double;
store, cache and slot table are real. The child reports what it saw as JSON; the assertions are
here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.helpers.mount_ns import run_python_in_mount_namespace


def test_disk_full_mid_download_and_read_only_cache(tmp_path):
    out = run_python_in_mount_namespace(__name__, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # Room for one of two concurrent misses: one is served, the other refused before it starts.
    race = seen["race"]
    assert sorted(race["outcomes"]) == ["CacheFull", "served"], race
    assert race["status"] == 507 and race["retry_after_s"] and "promised to downloads" in race["message"]
    # The disk filled up by someone else mid-download: 507 saying what to fix, then served.
    full = seen["full"]
    assert (full["outcome"], full["status"]) == ("CacheFull", 507) and "disk full" in full["message"]
    assert full["after_freeing"] == "served"
    # Read-only: the resident adapter keeps being served, a cold one is refused with a 507 that
    # names the cause, and once writable again it is served.
    assert seen["ro"]["resident"] == "served" and seen["ro"]["cold"] == "CacheUnwritable"
    assert seen["ro"]["status"] == 507 and "not writable" in seen["ro"]["message"]
    assert seen["ro"]["after_rw"] == "served"
    # After every fault: no partial files, the table is what the engine holds, no pin left.
    for phase in ("race", "full", "ro"):
        inv = seen[phase]["invariants"]
        assert inv["tmp_files"] == [] and inv["incomplete_objects"] == [], (phase, inv)
        assert inv["table"] == inv["engine"] and inv["active"] == 0, (phase, inv)


# ---- the child, inside its mount namespace -----------------------------------------------------


def _invariants(cache, slots, engine, manifests) -> dict:
    from adapters_registry.verify import sha256_file

    tmp_files = sorted(str(p.relative_to(cache.root)) for p in cache.tmp.rglob("*") if p.is_file())
    by_digest = {m.content_digest: m for m in manifests}
    incomplete = []
    for d in cache.objects.iterdir():
        m = by_digest[d.name]
        if any(not (d / f.name).is_file() or sha256_file(d / f.name) != (f.sha256, f.size) for f in m.files):
            incomplete.append(d.name)
    return {
        "tmp_files": tmp_files,
        "incomplete_objects": incomplete,
        "table": sorted(r["lora_name"] for r in slots.snapshot()),
        "engine": sorted(engine.names()),
        "active": sum(r["active_requests"] for r in slots.snapshot()),
    }


def _filling_store(store_cls, root: Path, filler: Path, fill_bytes: int):
    """A local store whose downloads first let another writer fill the disk (``filler``)."""

    class FillingStore(store_cls):
        def download_file(self, manifest, name, dest):
            if not filler.exists():
                with open(filler, "wb") as f:
                    try:
                        f.write(b"\0" * fill_bytes)
                    except OSError:
                        pass  # the disk is full: that was the point
            return super().download_file(manifest, name, dest)

    return FillingStore((root / "store").as_uri())


async def _error_of(slots, store, manifest) -> tuple[str, dict]:
    from adapters_registry.errors import RegistryError

    try:
        async with slots.use(store, manifest):
            return "served", {}
    except RegistryError as exc:
        return type(exc).__name__, {"status": exc.http_status, "message": exc.message,
                                    "retry_after_s": exc.retry_after_s}


async def _scenario(root: Path) -> dict:
    from adapters_registry.cache import AdapterCache
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.slots import AdapterSlots
    from adapters_registry.stores import open_store
    from adapters_registry.stores.local import LocalAdapterStore
    from benchmarks.synthetic_adapters import synthetic_adapter
    from tests.helpers.assets import tiny_assets
    from tests.helpers.engines import RecordingEngine
    from tests.helpers.mount_ns import mount_tmpfs, remount

    base = BaseModelInfo.from_model_dir(tiny_assets()["base"])
    store = open_store((root / "store").as_uri())
    ms = [store.publish(synthetic_adapter(root / f"src{i}", base, r=64, seed=i), f"big{i}", "acme", base)
          for i in range(3)]
    size = ms[0].total_bytes
    disk = root / "disk"
    mount_tmpfs(disk, int(size * 1.5))
    engine = RecordingEngine(4)
    cache = AdapterCache(disk / "cache", 10**12, attempts=1)  # the bound is not the limit: the disk is
    slots = AdapterSlots(engine, cache, 4)
    seen: dict = {}

    results = await asyncio.gather(_error_of(slots, store, ms[0]), _error_of(slots, store, ms[1]))
    outcomes = [r[0] for r in results]
    seen["race"] = {"outcomes": outcomes, **next((r[1] for r in results if r[1]), {}),
                    "invariants": _invariants(cache, slots, engine, ms)}

    async def clear():
        for m in ms:
            await slots.retire(m.adapter_id)
            await cache.evict(m)

    await clear()
    filler = disk / "someone-else.bin"
    outcome, error = await _error_of(slots, _filling_store(LocalAdapterStore, root, filler, int(size * 1.2)), ms[2])
    seen["full"] = {"outcome": outcome, **error, "invariants": _invariants(cache, slots, engine, ms)}
    filler.unlink()
    seen["full"]["after_freeing"] = (await _error_of(slots, store, ms[2]))[0]

    await clear()
    remount(disk, f"size={size * 3}")  # room for the read-only phase: only writability is missing
    async with slots.use(store, ms[0]):
        pass
    remount(disk, "ro")
    resident = (await _error_of(slots, store, ms[0]))[0]
    cold, error = await _error_of(slots, store, ms[2])
    ro_invariants = _invariants(cache, slots, engine, ms)
    remount(disk, "rw")
    seen["ro"] = {"resident": resident, "cold": cold, **error, "invariants": ro_invariants,
                  "after_rw": (await _error_of(slots, store, ms[2]))[0]}
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_scenario(Path(sys.argv[1])))))
