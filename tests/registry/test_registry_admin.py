"""Admin HTTP API (operator key) and the ``loraplex adapters`` CLI, against a real local store.

The gateway state is assembled from the real tenants directory, store, catalog and config; the
engine handle is a stand-in that forwards to a real ``AdapterSlots`` (whose engine is the
recording test double of vLLM's add/remove_lora).
"""

from __future__ import annotations

import json
import types

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from adapters_registry.cache import AdapterCache
from adapters_registry.manifest import CONFIG_NAME, WEIGHTS_NAME, AdapterManifest
from adapters_registry.slots import AdapterSlots
from adapters_registry.stores import open_store
from app.config import AppConfig
from app.gateway.admin_routes import router
from app.gateway.catalog import AdapterCatalog
from app.gateway.tenants import TenantDirectory, TenantsFile
from tests.helpers.assets import tiny_assets
from tests.helpers.engines import RecordingEngine


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class EngineHandle:
    """Stands in for the engine deployment handle: ``handle.method.remote(...)`` → awaitable."""

    def __init__(self, slots: AdapterSlots, store):
        self.slots, self.store = slots, store
        self.pin_adapter = _Remote(self._pin)
        self.unpin_adapter = _Remote(self._unpin)
        self.residency = _Remote(self._residency)

    async def _pin(self, manifest: dict):
        await self.slots.pin(self.store, AdapterManifest.model_validate(manifest))
        return self.slots.snapshot()

    async def _unpin(self, adapter_id: str):
        return {"rows": self.slots.unpin(adapter_id)}

    async def _residency(self):
        return {"capacity": self.slots.capacity, "slots": self.slots.snapshot(), "cache": self.slots.cache.snapshot()}


@pytest.fixture
def env(tmp_path):
    assets = tiny_assets()
    doc = TenantsFile()
    op_key = doc.add_key("ops", operator=True)
    user_key = doc.add_key("acme")
    doc.write(tmp_path / "tenants.yaml")
    store = open_store((tmp_path / "store").as_uri())
    cfg = AppConfig(store_uri=store.uri, engine={"model": str(assets["base"]), "max_lora_rank": 16})
    slots = AdapterSlots(RecordingEngine(2), AdapterCache(tmp_path / "cache", 10**9), 2)
    app = FastAPI()
    app.include_router(router)
    app.state.gateway = types.SimpleNamespace(
        tenants=TenantDirectory(tmp_path / "tenants.yaml"), store=store, catalog=AdapterCatalog(store),
        cfg=cfg, engine=EngineHandle(slots, store),
    )
    client = TestClient(app)
    return types.SimpleNamespace(client=client, store=store, op={"Authorization": f"Bearer {op_key}"},
                                 user={"Authorization": f"Bearer {user_key}"}, assets=assets, slots=slots)


def _files(folder, names=(CONFIG_NAME, WEIGHTS_NAME)):
    return [("files", (n, (folder / n).read_bytes(), "application/octet-stream")) for n in names]


def test_push_list_get_delete_over_http(env):
    c = env.client
    r = c.post("/admin/adapters", data={"adapter_id": "web", "tenant": "acme"}, files=_files(env.assets["attn"]), headers=env.op)
    assert r.status_code == 201, r.text
    assert r.json()["version"] == 1 and r.json()["owner_tenant"] == "acme"
    r = c.post("/admin/adapters", data={"adapter_id": "web", "tenant": "acme"}, files=_files(env.assets["experts3d"]), headers=env.op)
    assert r.json()["version"] == 2 and r.json()["layout"] == "2d"
    assert [a["adapter_id"] for a in c.get("/admin/adapters", headers=env.op).json()["adapters"]] == ["web"]
    assert c.get("/admin/adapters/web", headers=env.op).json()["versions"] == [1, 2]
    assert c.delete("/admin/adapters/web", headers=env.op).json()["versions"] == [1, 2]
    r = c.get("/admin/adapters/web", headers=env.op)
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]


def test_admin_needs_an_operator_key(env):
    c = env.client
    assert c.get("/admin/adapters").status_code == 401
    r = c.get("/admin/adapters", headers=env.user)
    assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    r = c.post("/admin/adapters", data={"adapter_id": "x", "tenant": "acme"}, files=_files(env.assets["attn"]), headers=env.user)
    assert r.status_code == 403 and env.store.list() == []


def test_hostile_uploads_refused_with_422(env):
    c = env.client
    r = c.post("/admin/adapters", data={"adapter_id": "x", "tenant": "acme"},
               files=[("files", ("adapter_model.bin", b"\x80\x04pickle", "application/octet-stream"))], headers=env.op)
    assert r.status_code == 422 and "pickle" in r.json()["error"]["message"]
    r = c.post("/admin/adapters", data={"adapter_id": "../../etc", "tenant": "acme"}, files=_files(env.assets["attn"]), headers=env.op)
    assert r.status_code == 422 and "invalid adapter id" in r.json()["error"]["message"]
    r = c.post("/admin/adapters", data={"adapter_id": "x", "tenant": "acme"},
               files=[("files", ("../adapter_config.json", b"{}", "application/json"))], headers=env.op)
    assert r.status_code == 422
    assert env.store.list() == []


def test_pin_unpin_residency(env):
    c = env.client
    c.post("/admin/adapters", data={"adapter_id": "p", "tenant": "acme"}, files=_files(env.assets["attn"]), headers=env.op)
    r = c.post("/admin/adapters/p/pin", headers=env.op)
    assert r.status_code == 200 and r.json()["pinned"] == "p@v1"
    rows = c.get("/admin/residency", headers=env.op).json()["slots"]
    assert [(x["lora_name"], x["operator_pinned"]) for x in rows] == [("p@v1", True)]
    assert c.post("/admin/adapters/p/unpin", headers=env.op).json()["engine"] == {"rows": 1}
    assert c.post("/admin/adapters/nope/pin", headers=env.op).status_code == 404


# ---- CLI ------------------------------------------------------------------------------------------


def test_cli_push_list_rm(tmp_path, capsys):
    from app.cli.main import main

    assets = tiny_assets()
    uri = (tmp_path / "store").as_uri()
    common = ["--store", uri]
    assert main(["adapters", "push", str(assets["attn"]), "--id", "cli-a", "--tenant", "acme",
                 "--base-model", str(assets["base"]), *common]) == 0
    assert "published cli-a version 1" in capsys.readouterr().out
    assert main(["adapters", "list", *common]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["ID", "VERSION", "TENANT"] and "cli-a" in out
    assert main(["adapters", "list", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)[0]["adapter_id"] == "cli-a"
    assert main(["adapters", "push", str(assets["attn"]), "--id", "../x", "--tenant", "acme",
                 "--base-model", str(assets["base"]), *common]) == 2
    assert "invalid adapter id" in capsys.readouterr().err
    assert main(["adapters", "rm", "cli-a", *common]) == 0
    assert main(["adapters", "rm", "cli-a", *common]) == 2
    assert "(404)" in capsys.readouterr().err


def test_cli_default_store_is_the_app_config_store(tmp_path, monkeypatch, capsys):
    from app.cli.main import main

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    assets = tiny_assets()
    assert main(["adapters", "push", str(assets["attn"]), "--id", "d", "--tenant", "acme",
                 "--base-model", str(assets["base"])]) == 0
    assert open_store((tmp_path / "home" / "store").as_uri()).get("d").version == 1


def test_cli_push_upload_part_size_reaches_the_s3_store_and_is_bounded(capsys):
    import argparse

    from app.cli.adapters_cmd import _store
    from app.cli.main import main

    store = _store(argparse.Namespace(store="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9", upload_part_mib=1024))
    assert store.transfer.multipart_threshold == store.transfer.multipart_chunksize == 1024 << 20
    assert _store(argparse.Namespace(store="s3://bucket/p", endpoint_url="http://127.0.0.1:9")).part_bytes == 32 << 20
    with pytest.raises(SystemExit):
        main(["adapters", "push", ".", "--id", "a", "--tenant", "t", "--upload-part-mib", "3"])
    assert "3 MiB: S3 parts are 5 to 5120 MiB" in capsys.readouterr().err
