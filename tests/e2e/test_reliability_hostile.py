"""Hostile clients against the session stack: malformed and oversized requests, invalid sampling
values, unicode edge cases, clients that vanish mid-stream, one tenant opening many connections.
Every refusal is a 4xx with a JSON body that says what to fix; nothing is a 5xx; afterwards the
invariants hold (``tests.helpers.invariants``)."""

from __future__ import annotations

import collections
import json
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.completions import signal_each

pytestmark = pytest.mark.e2e
BASE = "loraplex-base"
HOSTILE = [  # (route, raw body, expected status, words the error message must contain)
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":Infinity}', 400, ["Infinity"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"temperature":NaN}', 400, ["NaN"]),
    ("completions", b'{"model":{"a":1},"prompt":"x","max_tokens":2}', 400, ["model"]),
    ("completions", b'{"model":["acme-support"],"prompt":"x"}', 400, ["model"]),
    ("completions", b'{"model":5,"prompt":"x","max_tokens":2}', 400, ["model"]),
    ("completions", b'{"model":"../../etc/passwd","prompt":"x"}', 422, ["invalid adapter id"]),
    ("completions", '{"model":"\u00e9t\u00e9","prompt":"x"}'.encode(), 422, ["invalid adapter id"]),
    ("completions", b'{"model":"loraplex-base","prompt":"\\ud800 hi","max_tokens":2}', 400, ["surrogate", "prompt"]),
    ("chat/completions", b'{"model":"acme-support","messages":[{"role":"user","content":"\\udfff"}]}', 400,
     ["surrogate", "messages[0].content"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":100000000}', 400, ["max_tokens"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":-1}', 400, ["max_tokens"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":1e300}', 400, ["max_tokens"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"temperature":-1}', 400, ["temperature"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"top_p":5}', 400, ["top_p"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"top_k":-7}', 400, ["top_k"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"logprobs":1000}', 400, ["logprobs"]),
    ("completions", b'{"model":"loraplex-base","prompt":[99999999],"max_tokens":2}', 400, ["vocabulary"]),
    ("completions", b'{"model":"loraplex-base","prompt":[-5],"max_tokens":2}', 400, ["prompt"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"logit_bias":{"999999":100}}', 400, ["logit_bias"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"seed":99999999999999999999999}', 400, ["seed"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"stream":"perhaps"}', 400, ["stream"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2,"structured_outputs":{"regex":"(("}}', 400, ["regex"]),
    ("completions", ('{"model":"loraplex-base","prompt":"' + "hello " * 5000 + '","max_tokens":2}').encode(), 400,
     ["maximum context length"]),
    ("completions", ('{"model":"loraplex-base","prompt":"x","max_tokens":2,"stop":[' + ",".join(['"ab"'] * 5000) + "]}").encode(), 400,
     ["stop"]),
    ("chat/completions", b'{"model":"loraplex-base","messages":[],"max_tokens":2}', 400, ["empty conversation"]),
    ("chat/completions", b'{"model":"loraplex-base","messages":"hi"}', 400, ["messages"]),
    ("chat/completions", b'{"model":"loraplex-base","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}', 400,
     ["tools"]),
    ("completions", b'[1,2]', 400, ["JSON object"]),
    ("completions", b'{"model":"loraplex-base"', 400, ["not valid JSON"]),
    ("completions", b'', 400, ["not valid JSON"]),
    ("completions", b'{"model":"loraplex-base","prompt":"\xff\xfe"}', 400, ["not valid JSON"]),
    ("completions", b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}", 400, ["not valid JSON"]),
    ("completions", b'{"model":"loraplex-base","prompt":"x","max_tokens":2}', 200, []),  # the control
]
ODD_BUT_VALID = [  # served: unicode edge cases that are valid text
    {"prompt": "a\u0000b"}, {"prompt": "\u202eevil\u202c"}, {"prompt": "e\u0301\u0301\u0301"},
    {"prompt": "\U0001f600\U0001f9ea" * 50}, {"prompt": "\ufeffbom"}, {"prompt": "\u0000" * 200},
    {"prompt": "x", "stop": ["\U0001f600"]}, {"prompt": "\u4e2d\u6587 \u0440\u0443\u0441"},
]


def _post(stack, route: str, content: bytes, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/{route}", content=content, timeout=timeout,
                      headers={**stack.headers("acme"), "content-type": "application/json", **(headers or {})})


def assert_json_error(r: httpx.Response, status: int, words=()) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["code"] == status and err["message"], err
    for word in words:
        assert word in err["message"], (word, err["message"])


@pytest.mark.parametrize("route,content,status,words", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_bodies_get_a_json_error_that_says_what_to_fix(serve_stack, route, content, status, words):
    r = _post(serve_stack, route, content)
    if status == 200:
        assert r.status_code == 200 and r.json()["choices"], r.text
    else:
        assert_json_error(r, status, words)


def test_unicode_edge_cases_are_served(serve_stack):
    for extra in ODD_BUT_VALID:
        r = _post(serve_stack, "completions", json.dumps({"model": "acme-support", "max_tokens": 4, **extra}).encode())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, (extra, r.text[:300])


SMALL = b'{"model":"loraplex-base","prompt":"x","max_tokens":2}'


def test_headers_the_gateway_allows_pass_haproxy_and_larger_ones_get_its_json_431(serve_stack):
    """HAProxy's buffer is sized above the gateway's header limit (``app.cli.serve_env``): headers
    below the limit are served although above Serve's default buffer (16 KiB), and headers just
    above it get the gateway's JSON 431, not HAProxy's HTML 400."""
    from app.config import AppConfig

    limit = AppConfig.model_fields["max_header_bytes"].default  # the stack's: its config leaves it
    r = _post(serve_stack, "completions", SMALL, {"x-junk": "a" * (limit // 2)})
    assert r.status_code == 200, r.text[:300]
    assert_json_error(_post(serve_stack, "completions", SMALL, {"x-junk": "a" * (limit + 1024)}), 431, ["headers"])


@pytest.mark.xfail(strict=True, reason="known defect of the HAProxy data path: headers above HAProxy's buffer, or "
                   "more than its 101 header lines (tune.http.maxhdr, not settable through Serve), get HAProxy's "
                   "own HTML 400 before the gateway's JSON 431; HAProxy before 3.2 ignores `errorfile 400` for "
                   "requests it cannot parse (haproxy/haproxy#3032; Ray bundles 2.8)")
def test_huge_headers_are_refused_with_a_json_431(serve_stack):
    assert_json_error(_post(serve_stack, "completions", SMALL, {"x-junk": "a" * (1 << 20)}), 431, ["headers"])
    many = {f"x-h{i}": "v" * 100 for i in range(1000)}
    assert_json_error(_post(serve_stack, "completions", SMALL, many), 431, ["headers"])


def test_huge_bodies_are_refused_before_any_work(serve_stack):
    small = SMALL
    huge = b'{"model":"loraplex-base","max_tokens":2,"prompt":"' + b"a" * (64 << 20) + b'"}'
    t0 = time.monotonic()
    assert_json_error(_post(serve_stack, "completions", huge), 413, ["body", "limit"])
    assert time.monotonic() - t0 < 60
    assert _post(serve_stack, "completions", small).status_code == 200  # and the gateway still serves


def _add_key(stack, name: str, **fields) -> dict[str, str]:
    from app.gateway.tenants import TenantsFile

    path = stack.home / "tenants.yaml"
    doc = TenantsFile.read(path)
    key = doc.add_key(name, **fields)
    doc.write(path)
    return {"Authorization": f"Bearer {key}"}


class _Reader(threading.Thread):
    """Reads an SSE completion stream to its end, counting data events."""

    def __init__(self, stack, headers, body):
        super().__init__(daemon=True)
        self.stack, self.headers, self.body = stack, headers, body
        self.events, self.replica, self.tokens = 0, None, None
        self.started, self.done = threading.Event(), threading.Event()

    def run(self):
        body = {**self.body, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.stack.base_url + "/v1/completions", headers=self.headers, json=body,
                          timeout=300) as s:
            self.replica = s.headers.get("x-loraplex-replica")
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    self.events += 1
                    self.started.set()
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        self.tokens = usage["completion_tokens"]
        self.done.set()


def _raw_request(stack, headers: dict, body: dict) -> socket.socket:
    """A POST on a plain socket, so the test decides when the client vanishes."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Type": "application/json",
                                                  "Content-Length": len(data), "Connection": "close"}.items())
    port = int(stack.base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode() + data)
    return sock


def _wait(condition, timeout_s: float = 120, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-streamed"])
def test_client_gone_aborts_the_request_and_unpins_the_adapter(serve_stack, replica_probe, stack_invariants, stream):
    """A client asks for 1000 tokens and vanishes once its request runs (streamed: once the first
    chunks arrived). Its key's one admission slot must come back, and the engine must stop
    generating: while a later 600-token stream of the same key and adapter flows, it is the only
    request pinning the adapter and the only one inside the engines."""
    adapter = "acme-support" if stream else "globex-legal"
    headers = _add_key(serve_stack, f"rel-gone-{adapter}", adapters=[adapter], max_concurrency=1)
    base = json.dumps({"model": BASE, "prompt": "x", "max_tokens": 1}).encode()
    body = {"model": adapter, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    engines = [pid for pids in replica_probe.engine_processes().values() for pid in pids]
    leaver = _raw_request(serve_stack, headers, {**body, "max_tokens": 2000})
    frozen = False
    try:
        if stream:
            assert b"data: {" in leaver.recv(4096) or b"data: {" in leaver.recv(4096)  # the stream is flowing
        else:  # running in an engine before the first probe: a probe admitted first would refuse the leaver
            _wait(lambda: _active(replica_probe, adapter)[0] >= 1, what="the leaving request to run in an engine")
            signal_each(engines, signal.SIGSTOP)  # the leaver cannot finish while the probes look
            frozen = True
            _slot_taken(serve_stack, base, headers, leaver)  # refused at admission: no engine needed
    finally:
        leaver.close()
        if frozen:
            signal_each(engines, signal.SIGCONT)
    _wait(lambda: _post(serve_stack, "completions", base, headers).status_code == 200,
          what="the admission slot back after the client left")
    keeper = _Reader(serve_stack, headers, {**body, "max_tokens": 600, "stream": True})
    keeper.start()
    assert keeper.started.wait(300)
    pinning, in_engines = _active(replica_probe, adapter)
    assert pinning <= 1 and in_engines <= 1, (pinning, in_engines)  # at most the keeper: the vanished request is gone
    keeper.join(300)
    assert keeper.done.is_set() and keeper.tokens == 600
    assert stack_invariants() == []


def _slot_taken(stack, base: bytes, headers: dict, leaver: socket.socket, timeout_s: float = 120) -> None:
    """Waits until the key's one admission slot is taken by ``leaver``'s request (a base-model request
    of the key is a 429); on a timeout says what the probes got and what the leaver was answered."""
    seen: collections.Counter = collections.Counter()

    def taken() -> bool:
        status = _post(stack, "completions", base, headers).status_code
        seen[status] += 1
        return status == 429

    try:
        _wait(taken, timeout_s, "the key's slot taken")
    except AssertionError:
        leaver.settimeout(1)
        try:
            answer = leaver.recv(2048)
        except OSError as exc:
            answer = repr(exc).encode()
        raise AssertionError(f"the key's slot was never seen taken in {timeout_s} s: probes {dict(seen)}, "
                             f"the leaving request was answered {answer[:600]!r}") from None


def _active(probe, adapter_id: str) -> tuple[int, int]:
    """(requests pinning ``adapter_id``, requests inside the engines) over every replica."""
    views = probe.replicas()
    return (sum(row["active_requests"] for v in views for row in v.get("slots", []) if row["adapter_id"] == adapter_id),
            sum(v.get("engine_requests") or 0 for v in views))


def test_client_gone_before_the_first_byte_releases_admission_and_the_pin(serve_stack, replica_probe, stack_invariants,
                                                                           embedded_model_dir, tmp_path):
    """The client leaves while the gateway still waits for the stream's head (the adapter's first
    download from S3 is stalled, so not a byte of the response exists yet). Its admission slot must
    come back at once, and once the store answers again the engine must not run the request: while
    a later stream of the adapter flows, it is the only request pinning the adapter."""
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter

    aid = f"rel-early-{uuid.uuid4().hex[:6]}"
    store = open_store(serve_stack.store_uri, serve_stack.s3_endpoint)  # straight to S3, not through the faults
    store.publish(build_peft_adapter(embedded_model_dir, tmp_path / "a", "attention", 8, 731), aid, "acme",
                  BaseModelInfo.from_model_dir(embedded_model_dir))
    headers = _add_key(serve_stack, "rel-early", adapters=[aid], max_concurrency=1, tokens_per_minute=4000)
    # The gateway learns the manifest from a request refused after authorisation (over the budget),
    # so it can serve it while the store stalls; no engine has seen the adapter yet.
    over = json.dumps({"model": aid, "prompt": "a" * 20000, "max_tokens": 2}).encode()
    assert_json_error(_post(serve_stack, "completions", over, headers), 429, ["budget"])
    base = json.dumps({"model": BASE, "prompt": "x", "max_tokens": 1}).encode()
    body = {"model": aid, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    serve_stack.s3_faults.set("stall")
    try:
        leaver = _raw_request(serve_stack, headers, body)
        # admitted and waiting for the engine: the key's one slot is taken
        _slot_taken(serve_stack, base, headers, leaver)
        leaver.settimeout(1)
        with pytest.raises(socket.timeout):
            leaver.recv(1)  # nothing of the response yet
        leaver.close()
        _wait(lambda: _post(serve_stack, "completions", base, headers).status_code == 200,
              what="the admission slot back after the client left")
    finally:
        serve_stack.s3_faults.set("pass")
    other = _add_key(serve_stack, "rel-early-2", adapters=[aid])
    keeper = _Reader(serve_stack, other, {**body, "max_tokens": 600})
    keeper.start()
    assert keeper.started.wait(300)
    pinning, in_engines = _active(replica_probe, aid)
    assert pinning <= 1 and in_engines <= 1, (pinning, in_engines)  # at most the keeper: the vanished request never ran
    keeper.join(300)
    assert keeper.done.is_set() and keeper.tokens == 600
    store.delete(aid)
    assert stack_invariants() == []


def test_many_connections_from_one_tenant_only_get_deliberate_refusals(serve_stack, stack_invariants):
    """96 requests at once against a cap of 4 in flight: more than the cap plus the 64 a gateway lets
    wait (max_waiting_per_tenant), so some are refused unless the engine finishes 32-token requests
    faster than the threads can send them (the cap's 1 s wait alone may refuse none when the engine is fast)."""
    headers = _add_key(serve_stack, "rel-flood", adapters=["acme-support"], max_concurrency=4)

    def one(i: int) -> tuple[int, dict | None, int]:
        body = {"model": "acme-support", "prompt": f"flood {i}", "max_tokens": 32, "ignore_eos": True}
        url = serve_stack.base_url + "/v1/completions"
        if i % 2:
            with httpx.stream("POST", url, headers=headers, timeout=300,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
                if s.status_code != 200:
                    s.read()
                    return s.status_code, {**s.json(), "retry": s.headers.get("retry-after")}, 0
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
                return 200, None, events[-1]["usage"]["completion_tokens"]
        r = httpx.post(url, headers=headers, json=body, timeout=300)
        if r.status_code != 200:
            return r.status_code, {**r.json(), "retry": r.headers.get("retry-after")}, 0
        return 200, None, r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(96) as pool:
        results = list(pool.map(one, range(96)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 4 and statuses.count(429) >= 1
    for status, err, tokens in results:
        if status == 429:
            assert err["retry"] and "in flight" in err["error"]["message"], err
        else:
            assert tokens == 32
    assert stack_invariants() == []
