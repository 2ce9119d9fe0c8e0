"""End to end through the real stack with the OpenAI SDK: outputs equal transformers + PEFT."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import hf_reference as ref

pytestmark = pytest.mark.e2e
PROMPTS = ["hello world", "please route 42 requests to the expert"]
MAX_TOKENS = 12
ATTENTION_ADAPTERS = {"acme-support": "acme", "globex-legal": "globex"}


def client(stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys[tenant], max_retries=0)


def served_chat_ids(stack, tenant: str, model: str, prompt: str) -> list[int]:
    """Greedy chat completion; token ids via vLLM's return_tokens_as_token_ids."""
    out = client(stack, tenant).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0, logprobs=True, extra_body={"return_tokens_as_token_ids": True},
    )
    return [int(t.token.split(":")[1]) for t in out.choices[0].logprobs.content]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_base_model_matches_transformers(serve_stack, embedded_model_dir, prompt):
    ids = ref.chat_prompt_ids(embedded_model_dir, prompt)
    expected = ref.greedy(embedded_model_dir, None, ids, MAX_TOKENS)
    assert served_chat_ids(serve_stack, "acme", "loraplex-base", prompt) == expected


@pytest.mark.parametrize("adapter_id", sorted(ATTENTION_ADAPTERS))
def test_adapters_match_peft_and_differ_from_base(serve_stack, embedded_model_dir, demo_adapter_sources, adapter_id):
    tenant = ATTENTION_ADAPTERS[adapter_id]
    for prompt in PROMPTS:
        ids = ref.chat_prompt_ids(embedded_model_dir, prompt)
        expected = ref.greedy(embedded_model_dir, demo_adapter_sources[adapter_id], ids, MAX_TOKENS)
        served = served_chat_ids(serve_stack, tenant, adapter_id, prompt)
        assert served == expected
        assert served != ref.greedy(embedded_model_dir, None, ids, MAX_TOKENS)


def test_expert_lora_adapter_matches_peft(serve_stack, embedded_model_dir, demo_adapter_sources,
                                         tmp_path):
    """An attention + MoE-expert adapter (pushed in PEFT's fused 3-D layout) equals PEFT exactly,
    and its expert part shows: without it PEFT's greedy tokens differ."""
    from tests.helpers.expert_lora import attention_only_copy

    src = demo_adapter_sources["acme-experts"]
    attention_only = attention_only_copy(src, tmp_path / "attention-only")
    expert_part_shows = False
    for prompt in PROMPTS:
        ids = ref.chat_prompt_ids(embedded_model_dir, prompt)
        expected = ref.greedy(embedded_model_dir, src, ids, MAX_TOKENS)
        assert served_chat_ids(serve_stack, "acme", "acme-experts", prompt) == expected
        expert_part_shows |= expected != ref.greedy(embedded_model_dir, attention_only, ids,
                                                    MAX_TOKENS)
    assert expert_part_shows, "the expert LoRA changes no greedy token: this test proves nothing"


def test_per_expert_2d_adapter_pushed_to_s3_matches_merged_model(serve_stack, embedded_model_dir, tmp_path):
    """PEFT's per-expert (2-D) layout, with independent gate/up A matrices, through the stack."""
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from tests.helpers.expert_lora import (
        attention_only_copy,
        greedy_with,
        merged_model,
        write_per_expert_adapter,
    )

    src = write_per_expert_adapter(embedded_model_dir, tmp_path / "experts-2d", rank=8, seed=5)
    store = open_store(serve_stack.store_uri, serve_stack.s3_endpoint)
    m = store.publish(src, "acme-experts-2d", "acme", BaseModelInfo.from_model_dir(embedded_model_dir))
    assert m.has_expert_lora and m.layout == "2d"
    model = merged_model(embedded_model_dir, src)
    attention_only = attention_only_copy(src, tmp_path / "attention-only")
    eos = ref.tokenizer(str(embedded_model_dir)).eos_token_id
    expert_part_shows = False
    for prompt in PROMPTS:
        ids = ref.chat_prompt_ids(embedded_model_dir, prompt)
        expected = greedy_with(model, ids, MAX_TOKENS, eos)
        assert served_chat_ids(serve_stack, "acme", "acme-experts-2d", prompt) == expected
        expert_part_shows |= expected != ref.greedy(embedded_model_dir, attention_only, ids,
                                                    MAX_TOKENS)
    assert expert_part_shows, "the expert LoRA changes no greedy token: this test proves nothing"


def test_per_adapter_route_streaming_completion(serve_stack, embedded_model_dir, demo_adapter_sources):
    """Streamed token ids equal PEFT's (text may withhold an incomplete trailing UTF-8 sequence)."""
    prompt = "the expert said"
    ids = ref.prompt_ids(embedded_model_dir, prompt)
    expected = ref.greedy(embedded_model_dir, demo_adapter_sources["acme-support"], ids, MAX_TOKENS)
    sdk = openai.OpenAI(base_url=serve_stack.base_url + "/v1/adapters/acme-support", api_key=serve_stack.keys["acme"], max_retries=0)
    chunks = list(sdk.completions.create(
        model="acme-support", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    ))
    assert len(chunks) > 2, "expected several SSE chunks"
    streamed = [int(t.split(":")[1]) for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == expected


def test_streaming_chat_equals_non_streaming(serve_stack):
    sdk = client(serve_stack, "globex")
    kwargs = dict(model="globex-legal", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS, temperature=0)
    full = sdk.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full and full


def test_models_lists_only_the_tenants_adapters(serve_stack):
    ids = {m.id for m in client(serve_stack, "globex").models.list()}
    assert "globex-legal" in ids and "loraplex-base" in ids
    assert "acme-support" not in ids and "acme-experts" not in ids


def test_wrong_key_is_401(serve_stack):
    bad = openai.OpenAI(base_url=serve_stack.base_url + "/v1", api_key="lpx-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="loraplex-base", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = httpx.post(serve_stack.base_url + "/v1/completions", json={"model": "loraplex-base", "prompt": "x"})
    assert r.status_code == 401 and "Authorization" in r.json()["error"]["message"]


ADAPTER_ROUTES = [  # (path, JSON body) of every route that names an adapter; {a} is its id
    ("/v1/chat/completions", {"model": "{a}", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/completions", {"model": "{a}", "prompt": "x", "max_tokens": 2}),
    ("/v1/completions", {"model": "{a}", "prompt": "x", "max_tokens": 2, "stream": True}),
    ("/v1/adapters/{a}/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/adapters/{a}/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/adapters/{a}/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
]


def _ask(stack, tenant: str, adapter_id: str, path: str, body: dict, request_id: str | None = None) -> httpx.Response:
    filled = json.loads(json.dumps(body).replace("{a}", adapter_id))
    headers = stack.headers(tenant) | ({"x-request-id": request_id} if request_id else {})
    return httpx.post(stack.base_url + path.replace("{a}", adapter_id), headers=headers, json=filled, timeout=60)


@pytest.mark.parametrize("path,body", ADAPTER_ROUTES)
def test_another_tenants_adapter_answers_exactly_as_a_missing_one(serve_stack, path, body):
    """globex asks for acme's adapter and for one that does not exist: same status, same
    headers that say anything about the adapter, same body but for the id asked (OWASP API1:
    an adapter's existence does not leak). acme itself is served on the same route."""
    theirs = _ask(serve_stack, "globex", "acme-support", path, body, request_id="same-id")  # the body names it
    missing = _ask(serve_stack, "globex", "no-such-adapter", path, body, request_id="same-id")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.headers["content-type"] == missing.headers["content-type"]
    assert "x-loraplex-replica" not in theirs.headers and "x-loraplex-replica" not in missing.headers
    assert theirs.text == missing.text.replace("no-such-adapter", "acme-support")
    assert "another tenant" not in theirs.text and "acme" not in theirs.text.replace("acme-support", "")
    assert _ask(serve_stack, "acme", "acme-support", path, body).status_code == 200


def test_the_sdk_sees_another_tenants_adapter_as_not_found(serve_stack):
    with pytest.raises(openai.NotFoundError):
        client(serve_stack, "globex").chat.completions.create(
            model="acme-support", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_the_operator_sees_every_adapter(serve_stack):
    ids = {m.id for m in client(serve_stack, "operator").models.list()}
    assert {"acme-support", "acme-experts", "globex-legal"} <= ids


def test_unknown_adapter_is_404(serve_stack):
    with pytest.raises(openai.NotFoundError) as e:
        client(serve_stack, "acme").chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert "no-such-adapter" in str(e.value)


def test_bad_request_body_is_400_and_others_keep_being_served(serve_stack):
    r = httpx.post(serve_stack.base_url + "/v1/chat/completions", headers=serve_stack.headers("acme"),
                   json={"model": "acme-support", "messages": "not a list"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(serve_stack.base_url + "/v1/chat/completions", headers=serve_stack.headers("acme"), content=b"{not json")
    assert r.status_code == 400
    assert served_chat_ids(serve_stack, "globex", "globex-legal", PROMPTS[0])


def test_responses_name_the_engine_replica(serve_stack):
    body = {"model": "acme-support", "prompt": "x", "max_tokens": 2}
    r = httpx.post(serve_stack.base_url + "/v1/completions", headers=serve_stack.headers("acme"), json=body, timeout=60)
    assert r.status_code == 200 and r.headers["x-loraplex-replica"]
    with httpx.stream("POST", serve_stack.base_url + "/v1/completions", headers=serve_stack.headers("acme"),
                      json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["x-loraplex-replica"] == r.headers["x-loraplex-replica"]  # one replica here


def test_health_and_readiness(serve_stack):
    assert httpx.get(serve_stack.base_url + "/healthz").status_code == 200
    assert httpx.get(serve_stack.base_url + "/readyz", timeout=60).json() == {"status": "ready"}


def test_admin_api_needs_an_operator_and_shows_residency(serve_stack):
    r = httpx.get(serve_stack.base_url + "/admin/residency", headers=serve_stack.headers("acme"))
    assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    r = httpx.get(serve_stack.base_url + "/admin/residency", headers=serve_stack.headers("operator"), timeout=30)
    assert r.status_code == 200
    view = r.json()
    assert view["capacity"] == 4  # deploy/config.yaml's max_cpu_loras
    assert view["capacity_bytes"] is None  # no byte budget there: the count alone
    assert view["registered_bytes"] == sum(row["bytes"] for row in view["slots"])
    # the slot table is the engine's registry: vLLM holds exactly the table's adapters
    assert sorted(row["lora_int_id"] for row in view["slots"]) == view["engine_lora_ids"]
    assert all(row["adapter_id"] and row["version"] >= 1 for row in view["slots"])


def completion_replica(stack, tenant: str, model: str, max_tokens: int = 1) -> str:
    body = {"model": model, "prompt": "affinity", "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(stack.base_url + "/v1/completions", headers=stack.headers(tenant), json=body,
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-loraplex-replica"]


def test_adapter_affinity_keeps_an_adapter_on_the_replica_holding_it(serve_stack, replica_probe,
                                                                     demo_adapter_sources, embedded_model_dir):
    """Both engine replicas are up and serving (their residency answers through Ray, engines
    alive), yet 16 requests for an adapter stay on the one replica that loaded it; Serve's default
    router would spread them over the two (all on one replica by chance: p = 2^-15). The adapter is
    published for this test, so no replica holds it before (an adapter both hold may rightly go
    to either: holders rank oldest first)."""
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store

    live = [v["replica"] for v in replica_probe.replicas() if v.get("engine_alive")]
    assert len(live) == 2, f"expected two live engine replicas, saw {live}"
    store = open_store(serve_stack.store_uri, serve_stack.s3_endpoint)
    store.publish(demo_adapter_sources["globex-legal"], "globex-affinity", "globex",
                  BaseModelInfo.from_model_dir(embedded_model_dir))
    try:
        replicas = [completion_replica(serve_stack, "globex", "globex-affinity") for _ in range(16)]
        if len(set(replicas)) != 1 or replicas[0] not in live:
            views = [{k: v.get(k) for k in ("replica", "slots", "engine_requests", "engine_alive")}
                     for v in replica_probe.replicas()]
            pytest.fail(f"globex-affinity went to {' '.join(replicas)}; live {live}; replicas now: {views}")
    finally:
        store.delete("globex-affinity")


def test_sequential_base_requests_are_packed_onto_one_replica(serve_stack):
    """One request at a time always finds batch room on the oldest replica: the other stays idle
    (so an autoscaler can remove it)."""
    assert len({completion_replica(serve_stack, "acme", "loraplex-base") for _ in range(12)}) == 1


def test_tenant_limits_hold_for_streams_and_new_keys_work_without_restart(serve_stack):
    """A key added to the tenants file works at once; a stream holds its concurrency slot until it ends."""
    from app.gateway.tenants import TenantsFile

    path = serve_stack.home / "tenants.yaml"
    doc = TenantsFile.read(path)
    key = doc.add_key("limited", max_concurrency=1)
    doc.write(path)
    headers = {"Authorization": f"Bearer {key}"}
    long_body = {"model": "loraplex-base", "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
    short_body = {"model": "loraplex-base", "prompt": "x", "max_tokens": 1}
    url = serve_stack.base_url + "/v1/completions"
    refused = []
    with httpx.Client(timeout=120) as c:
        # The tiny CPU model can finish a whole stream before the second request arrives (a busy
        # machine delays it): then both are served and nothing is shown, so the pair is tried a
        # few times; a gateway that releases the slot at the response head is never refused.
        for _ in range(4):
            with c.stream("POST", url, headers=headers, json=long_body) as first:
                assert first.status_code == 200
                second = c.post(url, headers=headers, json=short_body)
                chunks = [line for line in first.iter_lines() if line.startswith("data: {")]
            assert chunks  # the stream itself was served
            if second.status_code != 200:
                refused.append(second)
                break
        assert refused, "a second request during the stream was never refused"
        assert refused[0].status_code == 429 and refused[0].headers["Retry-After"]
        assert "in flight" in refused[0].json()["error"]["message"]
        assert c.post(url, headers=headers, json=short_body).status_code == 200  # slot released
