"""The S3 store against s3rver (npm): a second S3 implementation that persists to disk and checks
credentials. s3rver is installed by ``scripts/s3rver.sh`` into a temp folder; skipped without npm."""

from __future__ import annotations

import os
import uuid

import pytest

from adapters_registry.cache import AdapterCache
from adapters_registry.errors import AdapterNotFound, StoreUnavailable
from adapters_registry.manifest import WEIGHTS_NAME
from adapters_registry.slots import AdapterSlots
from adapters_registry.stores import open_store
from adapters_registry.verify import sha256_file
from tests.helpers.aio import asynctest
from tests.helpers.assets import tiny_assets
from tests.helpers.engines import RecordingEngine
from tests.helpers.s3 import S3ServerProcess
from tests.helpers.s3 import s3rver_prefix as installed_s3rver


@pytest.fixture(scope="module")
def s3rver_prefix():
    return installed_s3rver()


def _store(server, bucket, **kw):
    return open_store(f"s3://{bucket}/lp", server.endpoint, max_attempts=1, **kw)


@asynctest
async def test_publish_fetch_delete_and_persistence_across_restart(s3rver_prefix, base, tmp_path):
    data = tmp_path / "s3data"
    bucket = f"lp-{uuid.uuid4().hex[:10]}"
    with S3ServerProcess("s3rver", data_dir=data, s3rver_prefix=s3rver_prefix) as server:
        server.make_bucket(bucket)
        store = _store(server, bucket)
        m_attn = store.publish(tiny_assets()["attn"], "attn", "acme", base)
        m_moe = store.publish(tiny_assets()["experts3d"], "moe", "acme", base)
        assert m_moe.layout == "2d" and [m.adapter_id for m in store.list()] == ["attn", "moe"]
    with S3ServerProcess("s3rver", data_dir=data, s3rver_prefix=s3rver_prefix) as server:  # same disk
        store = _store(server, bucket)
        assert store.get("moe") == m_moe and store.get("attn") == m_attn
        engine = RecordingEngine(1)
        slots = AdapterSlots(engine, AdapterCache(tmp_path / "cache", 10**9), 1)
        for m in (m_attn, m_moe, m_attn):  # capacity 1: each switch evicts and reloads
            async with slots.use(store, m) as req:
                assert sha256_file(os.path.join(req.lora_path, WEIGHTS_NAME))[0] == m.file(WEIGHTS_NAME).sha256
        assert engine.names() == {"attn@v1"}
        store.delete("moe")
        with pytest.raises(AdapterNotFound):
            store.get("moe")
        assert store.publish(tiny_assets()["experts3d"], "moe", "acme", base).version == 2


def test_wrong_credentials_are_refused_with_a_hint(s3rver_prefix, base, tmp_path, monkeypatch):
    bucket = f"lp-{uuid.uuid4().hex[:10]}"
    with S3ServerProcess("s3rver", data_dir=tmp_path / "d", s3rver_prefix=s3rver_prefix) as server:
        server.make_bucket(bucket)
        _store(server, bucket).publish(tiny_assets()["attn"], "a", "acme", base)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOT-A-KEY")  # s3rver checks the key id (not the secret)
        with pytest.raises(StoreUnavailable, match="check the S3 credentials") as ei:
            _store(server, bucket).get("a")
        assert ei.value.http_status == 503
