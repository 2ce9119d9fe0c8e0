"""S3 store against moto's S3 server on 127.0.0.1: publish/read/delete, races, and faults."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from adapters_registry.cache import AdapterCache
from adapters_registry.errors import AdapterInvalid, AdapterNotFound, StoreUnavailable
from adapters_registry.manifest import WEIGHTS_NAME, BaseModelInfo
from adapters_registry.slots import AdapterSlots, engine_lora_name
from adapters_registry.stores import open_store
from adapters_registry.verify import sha256_file
from benchmarks.synthetic_adapters import synthetic_adapter
from tests.helpers.aio import asynctest
from tests.helpers.assets import tiny_assets
from tests.helpers.change_marker import assert_marker_moves_on_every_change
from tests.helpers.engines import RecordingEngine
from tests.helpers.net import StallingProxy
from tests.helpers.s3 import MotoS3


@pytest.fixture(scope="module")
def s3():
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="module")
def base() -> BaseModelInfo:
    return BaseModelInfo.from_model_dir(tiny_assets()["base"])


@pytest.fixture
def bucket(s3) -> str:
    return s3.make_bucket(f"loraplex-{uuid.uuid4().hex[:12]}")


def s3_store(s3, bucket, **kw):
    kw.setdefault("max_attempts", 1)
    kw.setdefault("read_timeout_s", 5)
    return open_store(f"s3://{bucket}/adapters", kw.pop("endpoint", s3.endpoint), **kw)


def cache_files(cache):
    return {p for p in cache.root.rglob("*") if p.is_file()}


def test_change_marker_moves_after_every_publish_and_delete(s3, bucket, base):
    assert_marker_moves_on_every_change(s3_store(s3, bucket), tiny_assets()["attn"], base)


def test_publish_get_list_delete(s3, bucket, base):
    store = s3_store(s3, bucket)
    assets = tiny_assets()
    m1 = store.publish(assets["attn"], "acme-attn", "acme", base)
    m2 = store.publish(assets["experts3d"], "acme-attn", "acme", base)
    assert (m1.version, m2.version, m2.layout) == (1, 2, "2d")
    assert store.get("acme-attn") == m2 and store.get("acme-attn", 1) == m1
    assert [m.lora_name for m in store.list()] == ["acme-attn@v2"]
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert "adapters/acme-attn/1/manifest.json" in keys and "adapters/acme-attn/2/adapter_model.safetensors" in keys
    assert store.delete("acme-attn") == [1, 2]
    with pytest.raises(AdapterNotFound):
        store.get("acme-attn")
    assert store.list() == []
    assert store.publish(assets["attn"], "acme-attn", "acme", base).version == 3


def test_version_without_manifest_is_invisible(s3, bucket, base):
    store = s3_store(s3, bucket)
    store.publish(tiny_assets()["attn"], "a", "acme", base)
    s3.client().put_object(Bucket=bucket, Key="adapters/a/2/adapter_model.safetensors", Body=b"partial")
    assert store.versions("a") == [1] and store.get("a").version == 1


def test_concurrent_publishes_get_distinct_versions(s3, bucket, base):
    store = s3_store(s3, bucket)
    src = tiny_assets()["attn"]
    with ThreadPoolExecutor(4) as ex:
        ms = list(ex.map(lambda _: store.publish(src, "race", "acme", base), range(4)))
    assert sorted(m.version for m in ms) == [1, 2, 3, 4]
    assert store.versions("race") == [1, 2, 3, 4]


def test_hostile_adapter_leaves_bucket_unchanged(s3, bucket, base, tmp_path):
    store = s3_store(s3, bucket)
    store.publish(tiny_assets()["attn"], "good", "acme", base)
    before = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"])
    bad = synthetic_adapter(tmp_path / "bad", base, r=128)
    with pytest.raises(AdapterInvalid, match="max_lora_rank"):
        store.publish(bad, "good", "acme", base)
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.publish(tiny_assets()["attn"], "../../x", "acme", base)
    assert sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]) == before


@asynctest
async def test_multipart_ranged_download_verified(s3, bucket, base, tmp_path):
    store = s3_store(s3, bucket, part_bytes=64 * 1024, concurrency=4)
    src = synthetic_adapter(tmp_path / "src", base, r=16, experts="3d", seed=3)
    m = store.publish(src, "big", "acme", base)
    assert m.file(WEIGHTS_NAME).size > 10 * 64 * 1024
    cache = AdapterCache(tmp_path / "cache", 10**9)
    p = await cache.ensure_local(store, m)
    assert sha256_file(p / WEIGHTS_NAME) == (m.file(WEIGHTS_NAME).sha256, m.file(WEIGHTS_NAME).size)


def test_the_apps_s3_options_reach_the_store_its_replicas_open(s3, bucket, base):
    """``AppConfig.s3`` (download concurrency, range size, timeouts, retries) is what the gateway's and
    the engine's ``cfg.open_store()`` builds the S3 client with; out-of-range values are refused."""
    from pydantic import ValidationError

    from app.config import AppConfig

    s3_store(s3, bucket).publish(tiny_assets()["attn"], "a", "acme", base)
    cfg = AppConfig(store_uri=f"s3://{bucket}/adapters", s3_endpoint_url=s3.endpoint,
                    s3={"download_concurrency": 6, "part_mib": 8, "read_timeout_s": 7, "max_retries": 2})
    store = cfg.open_store()
    assert (store.concurrency, store.part_bytes) == (6, 8 << 20)
    client = store.client.meta.config
    assert (client.read_timeout, client.connect_timeout, client.retries["total_max_attempts"]) == (7, 5.0, 3)
    assert client.max_pool_connections >= 6
    assert [m.adapter_id for m in store.list()] == ["a"]
    for bad in ({"download_concurrency": 0}, {"part_mib": 4}, {"read_timeout_s": 0}, {"max_retries": -1}, {"retries": 3}):
        with pytest.raises(ValidationError):
            AppConfig(s3=bad)


# ---- faults --------------------------------------------------------------------------------------


@asynctest
async def test_store_down_is_503_and_cache_clean(s3, bucket, base, tmp_path):
    m = s3_store(s3, bucket).publish(tiny_assets()["attn"], "a", "acme", base)
    down = s3_store(s3, bucket, endpoint=f"http://127.0.0.1:{_closed_port()}", connect_timeout_s=1)
    with pytest.raises(StoreUnavailable, match="unreachable") as ei:
        down.get("a")
    assert ei.value.http_status == 503
    cache = AdapterCache(tmp_path / "cache", 10**9, attempts=2, backoff_s=0.01)
    with pytest.raises(StoreUnavailable):
        await cache.ensure_local(down, m)
    assert cache_files(cache) == set()


@asynctest
async def test_store_slow_times_out_as_503(s3, bucket, base, tmp_path):
    m = s3_store(s3, bucket).publish(tiny_assets()["attn"], "a", "acme", base)
    with StallingProxy(s3.port) as proxy:
        slow = s3_store(s3, bucket, endpoint=proxy.endpoint, read_timeout_s=0.5, connect_timeout_s=0.5)
        assert slow.get("a") == m  # through the proxy while it forwards
        proxy.stalled.set()
        with pytest.raises(StoreUnavailable, match="too slow|unreachable"):
            slow.get("a")
        cache = AdapterCache(tmp_path / "cache", 10**9, attempts=1)
        with pytest.raises(StoreUnavailable):
            await cache.ensure_local(slow, m)
        assert cache_files(cache) == set()


@pytest.mark.parametrize("concurrency", [1, 2])
@asynctest
async def test_object_deleted_mid_download(concurrency, s3, bucket, base, tmp_path):
    store = s3_store(s3, bucket, part_bytes=64 * 1024, concurrency=concurrency)
    m = store.publish(synthetic_adapter(tmp_path / "src", base, r=16, experts="3d"), "gone", "acme", base)
    calls = {"n": 0}
    other = s3.client()

    def delete_after_first_range(**_):
        calls["n"] += 1
        # streamed: after the config file, before the weights; ranged: after the first range
        if calls["n"] == (2 if concurrency == 1 else 3):
            store.delete("gone")

    store.client.meta.events.register("before-call.s3.GetObject", delete_after_first_range)
    cache = AdapterCache(tmp_path / "cache", 10**9, attempts=2, backoff_s=0.01)
    with pytest.raises(AdapterNotFound) as ei:
        await cache.ensure_local(store, m)
    assert ei.value.http_status == 404
    assert cache_files(cache) == set()
    assert other.list_objects_v2(Bucket=bucket, Prefix="adapters/gone/1/").get("KeyCount", 0) == 0


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
@asynctest
async def test_corrupt_or_truncated_object_is_422(damage, concurrency, s3, bucket, base, tmp_path):
    store = s3_store(s3, bucket, part_bytes=64 * 1024, concurrency=concurrency)
    m = store.publish(synthetic_adapter(tmp_path / "src", base, r=16, experts="3d"), "bad", "acme", base)
    key = "adapters/bad/1/adapter_model.safetensors"
    data = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        del data[-5000:]
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    cache = AdapterCache(tmp_path / "cache", 10**9, attempts=2, backoff_s=0.01)
    with pytest.raises(AdapterInvalid, match="corrupt") as ei:
        await cache.ensure_local(store, m)
    assert ei.value.http_status == 422 and "re-push" in ei.value.message
    assert cache_files(cache) == set()


@asynctest
async def test_engine_keeps_serving_resident_adapters_while_store_is_down(s3, bucket, base, tmp_path):
    store = s3_store(s3, bucket)
    m0 = store.publish(synthetic_adapter(tmp_path / "a", base, r=4, seed=1), "a", "acme", base)
    m1 = store.publish(synthetic_adapter(tmp_path / "b", base, r=4, seed=2), "b", "acme", base)
    engine = RecordingEngine(2)
    slots = AdapterSlots(engine, AdapterCache(tmp_path / "cache", 10**9, attempts=1), 2)
    async with slots.use(store, m0):
        pass
    down = s3_store(s3, bucket, endpoint=f"http://127.0.0.1:{_closed_port()}", connect_timeout_s=1)
    with pytest.raises(StoreUnavailable):
        async with slots.use(down, m1):
            pass
    async with slots.use(down, m0) as req:  # resident: no store access needed
        assert req.lora_name == engine_lora_name(m0)
    assert slots.resident() == ["a"] and engine.names() == {"a@v1"}


def test_missing_bucket_says_what_to_fix(s3):
    """(Wrong credentials: moto accepts any key; ``test_registry_s3rver.py`` checks them.)"""
    with pytest.raises(StoreUnavailable, match="does not exist"):
        open_store("s3://no-such-bucket-here/x", s3.endpoint, max_attempts=1).list()


def _closed_port() -> int:
    from tests.helpers.net import free_port

    return free_port()


@pytest.mark.parametrize("concurrency", [1, 4])
@asynctest
async def test_part_hashes_verified_streamed_and_ranged(concurrency, s3, bucket, base, tmp_path, monkeypatch):
    import adapters_registry.stores.base as store_mod

    monkeypatch.setattr(store_mod, "PART_BYTES", 16 * 1024)
    store = s3_store(s3, bucket, part_bytes=16 * 1024, concurrency=concurrency)
    m = store.publish(synthetic_adapter(tmp_path / "src", base, r=16, experts="3d"), "parts", "acme", base)
    w = m.file(WEIGHTS_NAME)
    assert w.part_bytes == 16 * 1024 and len(w.part_sha256) > 8
    p = await AdapterCache(tmp_path / "ok", 10**9).ensure_local(store, m)
    assert sha256_file(p / WEIGHTS_NAME) == (w.sha256, w.size)
    key = "adapters/parts/1/adapter_model.safetensors"
    data = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    data[5 * w.part_bytes + 3] ^= 0x01
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    cache = AdapterCache(tmp_path / "bad", 10**9, attempts=1)
    with pytest.raises(AdapterInvalid, match="sha256 mismatch in part 5 of"):
        await cache.ensure_local(store, m)
    assert cache_files(cache) == set()


def test_publish_reports_upload_progress_in_bytes(s3, bucket, base):
    calls = []
    m = s3_store(s3, bucket).publish(tiny_assets()["attn"], "acme-progress", "acme", base,
                                     progress=lambda n, total: calls.append((n, total)))
    assert {total for _, total in calls} == {m.total_bytes} and sum(n for n, _ in calls) == m.total_bytes


def test_downloads_skip_the_sdks_redundant_crc32_pass(s3, bucket, base, tmp_path):
    """An object written in one PUT carries a whole-object CRC32 that boto3 would recompute on the
    reading thread of every download; the store reads it without (the sha256 parts verify it)."""
    from botocore.httpchecksum import StreamingChecksumBody

    store = s3_store(s3, bucket, part_bytes=1 << 30)  # one PUT per file
    m = store.publish(synthetic_adapter(tmp_path / "src", base, r=16, experts="3d"), "one-put", "acme", base)
    key = "adapters/one-put/1/adapter_model.safetensors"
    assert isinstance(s3.client().get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")["Body"],
                      StreamingChecksumBody)  # the SDK's default would check it
    with store.open_file(m, WEIGHTS_NAME) as src:
        assert not isinstance(src.body, StreamingChecksumBody)
        assert len(src.read()) == m.file(WEIGHTS_NAME).size
