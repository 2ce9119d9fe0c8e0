"""Unit tests of the serving path's pure parts: tenants, admission, config, app wiring, errors."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from pydantic import ValidationError

from app.config import AppConfig, EngineConfig
from app.errors import RateLimited, Unauthorized, error_response
from app.gateway.admission import Admission
from app.gateway.tenants import Tenant, TenantDirectory, TenantsFile, hash_key


def test_tenants_file_round_trip_and_reload(tmp_path):
    path = tmp_path / "tenants.yaml"
    doc = TenantsFile()
    key = doc.add_key("acme")
    doc.write(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert key not in path.read_text() and hash_key(key) in path.read_text()
    directory = TenantDirectory(path)
    assert directory.authenticate(f"Bearer {key}").name == "acme"
    with pytest.raises(Unauthorized):
        directory.authenticate("Bearer lpx-wrong")
    with pytest.raises(Unauthorized):
        directory.authenticate(None)
    doc = TenantsFile.read(path)
    key2 = doc.add_key("globex")
    doc.write(path)
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    assert directory.authenticate(f"Bearer {key2}").name == "globex"  # reloaded without restart


def test_broken_tenants_file_keeps_the_last_good_table(tmp_path):
    path = tmp_path / "tenants.yaml"
    doc = TenantsFile()
    key = doc.add_key("acme")
    doc.write(path)
    directory = TenantDirectory(path)
    path.write_text("tenants: [{name: 'bad name with spaces'}]")
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    assert directory.authenticate(f"Bearer {key}").name == "acme"


def test_tenant_may_use():
    t = Tenant(name="acme", adapters=["shared-x"])
    assert t.may_use("mine", "acme") and t.may_use("shared-x", "globex")
    assert not t.may_use("theirs", "globex")
    assert Tenant(name="ops", operator=True).may_use("theirs", "globex")


def test_admission_concurrency_and_token_budget():
    adm = Admission.local()
    tenant = Tenant(name="acme", max_concurrency=1, tokens_per_minute=100)

    async def run():
        async with adm.admit(tenant, 40):
            with pytest.raises(RateLimited) as e:
                async with adm.admit(tenant, 1):
                    pass
            assert e.value.retry_after_s
        async with adm.admit(tenant, 40):
            pass
        with pytest.raises(RateLimited) as e:  # 80 of 100 used, 40 more do not fit
            async with adm.admit(tenant, 40):
                pass
        assert e.value.retry_after_s > 0
        with pytest.raises(RateLimited, match="above the tenant's budget"):
            async with adm.admit(tenant, 1000):
                pass

    asyncio.run(run())


def test_global_in_flight_bound_gives_503():
    from app.errors import Overloaded

    adm = Admission.local(max_in_flight=1)

    async def run():
        async with adm.admit(Tenant(name="a"), 1):
            with pytest.raises(Overloaded) as e:
                async with adm.admit(Tenant(name="b"), 1):
                    pass
            assert e.value.http_status == 503
        async with adm.admit(Tenant(name="b"), 1):  # freed again
            assert adm.in_flight == 1

    asyncio.run(run())


def test_error_response_shape_and_retry_after():
    r = error_response(RateLimited("slow down", retry_after_s=2.4))
    assert r.status_code == 429 and r.headers["Retry-After"] == "2"
    body = json.loads(r.body)
    assert body["error"]["message"] == "slow down" and body["error"]["type"] == "rate_limit_error"
    assert error_response(ValueError("boom")).status_code == 500


def test_config_validation():
    with pytest.raises(ValidationError, match="max_cpu_loras"):
        EngineConfig(max_loras=8, max_cpu_loras=4)
    with pytest.raises(ValidationError, match="adapter_pinned_region_gib"):
        EngineConfig(adapter_pinning="pooled")  # pooled with no region to copy into
    assert EngineConfig(adapter_pinning="pooled", adapter_pinned_region_gib=4).adapter_pinned_region_gib == 4
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine": {"not_a_field": 1}})
    assert AppConfig().resolved_store_uri().startswith("file://")


def test_build_app_uses_the_adapter_affinity_router():
    from app.main import build_app

    app = build_app({"engine_deployment": {"num_replicas": 2}})
    gateway = app._bound_deployment
    engine = gateway.init_args[0]._bound_deployment
    assert engine.name == "Engine" and engine.num_replicas == 2
    assert engine._deployment_config.request_router_config.request_router_class == "app.routing.router:AdapterAffinityRouter"


def test_engine_wraps_only_the_modules_the_registry_serves_lora_for():
    from app.config import EngineConfig
    from app.engine.lora_targets import NON_EXPERT_LORA_TARGETS, SERVED_LORA_TARGETS
    from app.engine.vllm_serving import engine_kwargs

    assert set(SERVED_LORA_TARGETS) == set(NON_EXPERT_LORA_TARGETS) | {"experts"}
    # never the router (GPT-OSS ``router``, Qwen3-MoE ``gate``), embeddings or LM head
    assert not {"router", "gate", "embed_tokens", "lm_head"} & set(SERVED_LORA_TARGETS)
    assert engine_kwargs(EngineConfig())["lora_target_modules"] == list(SERVED_LORA_TARGETS)
    # CPU without loraplex's expert path: experts are no target
    off = engine_kwargs(EngineConfig(moe_lora_plugin=False))["lora_target_modules"]
    assert off == list(NON_EXPERT_LORA_TARGETS)
    assert engine_kwargs(EngineConfig(lora_target_modules=["q_proj"]))["lora_target_modules"] == ["q_proj"]


def test_a_stopping_engine_replica_waits_for_its_streams():
    from app.main import ENGINE_SHUTDOWN_GRACE_S, build_app

    engine = build_app({})._bound_deployment.init_args[0]._bound_deployment
    assert engine._deployment_config.graceful_shutdown_timeout_s == ENGINE_SHUTDOWN_GRACE_S
    engine = build_app({"engine_deployment": {"graceful_shutdown_timeout_s": 5}})._bound_deployment.init_args[0]
    assert engine._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 5


def test_a_tenants_file_caught_mid_write_keeps_the_table(tmp_path):
    """A writer that truncates and then writes (``Path.write_bytes``, an editor) leaves the file
    empty for a moment: a look then keeps the table and looks again, instead of a table without
    tenants answering every key 401. ``tenants: []`` written on purpose does empty it."""
    path = tmp_path / "tenants.yaml"
    doc = TenantsFile()
    key = doc.add_key("acme")
    doc.write(path)
    directory = TenantDirectory(path)
    path.write_bytes(b"")  # the truncation, before the new content arrives
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    assert directory.authenticate(f"Bearer {key}").name == "acme"
    key2 = doc.add_key("globex")
    doc.write(path)  # the content arrives: read at the next look
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 10))
    assert directory.authenticate(f"Bearer {key2}").name == "globex"
    path.write_text("tenants: []\n")
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 15))
    with pytest.raises(Unauthorized):
        directory.authenticate(f"Bearer {key}")
    # a directory that starts on an empty or missing file starts with no tenants
    assert TenantDirectory(tmp_path / "missing.yaml")._by_hash == {}
