"""Faults under the session stack, each followed by the invariants (``tests.helpers.invariants``):
the adapter store failing in the middle of a download (stopped, hung, erroring, slow), an adapter
deleted from the store while a stream uses it, the tenants file replaced by an invalid one, and an
engine process killed in the middle of a stream (vLLM #48966: the replica must be replaced, the
other one keeps serving). The store is reached through ``tests.helpers.s3_faults``; tests publish
to S3 directly, so only the stack sees the faults."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.helpers import admin
from tests.helpers.completions import Completion, StreamInChild, complete, signal_each

pytestmark = pytest.mark.e2e
TOKENS = 48


def _publish(stack, model_dir: Path, folder: Path, kind: str, seed: int, tenant: str = "acme") -> str:
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter

    aid = f"fault-{kind}-{uuid.uuid4().hex[:6]}"
    store = open_store(stack.store_uri, stack.s3_endpoint)  # straight to S3, not through the faults
    store.publish(build_peft_adapter(model_dir, folder / aid, kind, 8, seed), aid, tenant,
                  BaseModelInfo.from_model_dir(model_dir))
    return aid


def _body(aid: str, tokens: int = TOKENS, **extra) -> dict:
    return {"model": aid, "prompt": "the fault", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return found


@pytest.fixture(scope="module")
def fresh_adapter(serve_stack, embedded_model_dir, tmp_path_factory):
    """A new experts adapter (its weights are the largest: a download takes several reads) for
    every fault, so each download starts cold."""
    root = tmp_path_factory.mktemp("faults")
    seeds = iter(range(7000, 8000))

    def fresh() -> str:  # other bytes each time: the disk cache is content-addressed
        return _publish(serve_stack, embedded_model_dir, root, "experts", next(seeds))

    return fresh


@pytest.mark.parametrize("mode", ["down", "error", "stall", "slow"])
def test_store_fails_mid_download(serve_stack, fresh_adapter, stack_invariants, mode):
    """The fault starts after ~40 % of the adapter's bytes went to the replica. A stopped or
    erroring store is a 503 with Retry-After that names the store (never a 500, never a half
    adapter served); a hung store that comes back, or a slow one, serves the right tokens. After
    the fault the same request is served, with the same tokens as once the adapter is cached."""
    aid = fresh_adapter()
    faults = serve_stack.s3_faults
    faults.arm(mode, after_bytes=150_000)  # the experts adapter's weights are ~370 kB
    result: dict[str, Completion] = {}
    t = threading.Thread(target=lambda: result.update(c=complete(serve_stack, serve_stack.headers("acme"), _body(aid))))
    t.start()
    try:
        if mode == "stall":
            _wait(lambda: faults.mode == "stall", 120, "the download to reach the fault")
            time.sleep(3)  # hung for a while, then the store answers again
            faults.set("pass")
        t.join(600)
    finally:
        faults.set("pass")
    got = result["c"]
    if mode in ("down", "error"):
        assert got.status == 503 and got.retry_after, (got.status, got.error)
        assert "s3" in got.error["error"]["message"].lower() or "store" in got.error["error"]["message"].lower(), got.error
        got = complete(serve_stack, serve_stack.headers("acme"), _body(aid))
    assert got.status == 200 and len(got.tokens) == TOKENS, (got.status, got.error)
    again = complete(serve_stack, serve_stack.headers("acme"), _body(aid))  # from the verified cache entry
    assert again.status == 200 and again.tokens == got.tokens
    assert stack_invariants() == []


def test_adapter_deleted_from_the_store_while_a_stream_uses_it(serve_stack, fresh_adapter, stack_invariants):
    """The stream in flight finishes on the weights it started with; new requests are 404; no
    version is left half deleted."""
    aid = fresh_adapter()
    long_ref = complete(serve_stack, serve_stack.headers("acme"), _body(aid, 400))
    assert long_ref.status == 200
    streamer = StreamInChild(serve_stack, serve_stack.headers("acme"), _body(aid, 400, stream=True))
    assert streamer.first_token.wait(120)
    r = admin.delete(serve_stack, aid)
    assert r.status_code in (200, 204), r.text
    got = streamer.result(300)
    assert got.status == 200 and got.done and got.error is None, got.error
    assert got.tokens == long_ref.tokens
    gone = _wait(lambda: (c := complete(serve_stack, serve_stack.headers("acme"), _body(aid, 2))).status == 404 and c,
                 30, "the deleted adapter to be unknown")
    assert "does not exist" in gone.error["error"]["message"]
    assert stack_invariants() == []


def test_invalid_tenants_file_keeps_the_old_table(serve_stack):
    path = serve_stack.home / "tenants.yaml"
    good = path.read_bytes()
    base = {"model": "loraplex-base", "prompt": "x", "max_tokens": 1}
    try:
        for bad in (b"tenants: [unclosed", b"tenants:\n  - name: 'no good'\n    max_concurrency: -3\n", b"\xff\xfe"):
            path.write_bytes(bad)
            time.sleep(1.5)  # the gateways watch the file every 0.5 s: each bad version is seen
            r = httpx.post(serve_stack.base_url + "/v1/completions", headers=serve_stack.headers("acme"), json=base,
                           timeout=120)
            assert r.status_code == 200, (bad, r.text)
    finally:
        path.write_bytes(good)
    logs = Path(serve_stack.env["RAY_TMPDIR"]) / "ray" / "session_latest" / "logs"

    def logged():
        files = [serve_stack.log_path] + [p for p in logs.rglob("*") if p.is_file()]
        return any("not reloaded" in p.read_text(errors="replace") for p in files)

    _wait(logged, 30, "the refused tenants file in the stack's logs")
    r = httpx.post(serve_stack.base_url + "/v1/completions", headers=serve_stack.headers("acme"), json=base, timeout=120)
    assert r.status_code == 200


def test_engine_killed_mid_stream(serve_stack, replica_probe, stack_invariants):
    """SIGKILL of one replica's engine processes while it streams: the stream ends with an error
    event (no silent truncation), the other replica keeps serving (503 + Retry-After at most while
    the router learns), Serve replaces the replica, and the new one's slot table is its engine's.
    Every engine process is stopped at the stream's first token (``StreamInChild``'s freeze), so the
    kill lands mid-stream however slowly the host runs the test."""
    from tests.conftest import ENGINE_REPLICAS

    headers = serve_stack.headers("acme")
    body = _body("acme-support", 900, stream=True)
    engines = replica_probe.engine_processes()
    streamer = StreamInChild(serve_stack, headers, body, freeze=tuple(pid for pids in engines.values() for pid in pids))
    try:
        assert streamer.first_token.wait(120)
        victim = streamer.replica
        assert engines.get(victim), (victim, engines)
        signal_each(engines[victim], signal.SIGKILL)  # the replica's engine processes crash together
    finally:
        streamer.thaw()
    got = streamer.result(300)
    assert got.status == 200 and got.error is not None and got.done, (got.status, got.error, len(got.tokens))
    assert len(got.tokens) < 900
    # the survivor serves while the victim is replaced: 503 + Retry-After only until the router's
    # next stats report (period 1 s) marks the victim's engine dead
    statuses, errors = [], []
    deadline = time.monotonic() + 30
    while statuses.count(200) < 3 and time.monotonic() < deadline:
        c = complete(serve_stack, headers, _body("acme-support", 4, prompt=f"after {len(statuses)}"))
        statuses.append(c.status)
        errors.append((c.replica, c.error))
        assert c.status == 200 or (c.status == 503 and c.retry_after), (c.status, c.error)
        if c.status == 503:
            time.sleep(0.5)
    assert statuses.count(200) >= 3, (statuses, victim, errors)

    def replaced():
        now = replica_probe.replicas()
        return (len(now) == ENGINE_REPLICAS and victim not in {v["replica"] for v in now}
                and all(v.get("engine_alive") and "error" not in v for v in now) and now)

    _wait(replaced, 480, "Serve to replace the replica whose engine died")
    assert stack_invariants() == []
    assert complete(serve_stack, headers, _body("acme-support", 4)).status == 200
