"""A bounded load on loopback at about twice the embedded default's capacity.

The embedded default (deploy/config.yaml) runs one engine replica of ``max_num_seqs`` 16 and gives
a tenant 16 requests in flight; the session stack has two engine replicas, 32 sequences at once.
``CLIENTS`` = 64 closed-loop clients (streamed and not, three adapters and the base model) of four
tenants with 12 requests each in flight, for a fixed duration and at most ``MAX_REQUESTS``.
Every answer must be a completion of exactly the tokens asked for, or a deliberate refusal
(429 / 503 with Retry-After and a JSON message); afterwards the invariants hold. Latency
percentiles and the stack's memory are printed (``-s``) for benchmarks/RESULTS.md, not asserted.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

pytestmark = pytest.mark.e2e
CLIENTS = 64
DURATION_S = 40
MAX_REQUESTS = 1500
TOKENS = 12
TENANT_LIMIT = 12  # 4 tenants x 12 < 64 clients: some requests are refused on purpose
MODELS = ("acme-support", "globex-legal", "acme-experts", "loraplex-base")


def _stack_rss(stack) -> int:
    procs = [psutil.Process(stack.proc.pid)]
    procs += procs[0].children(recursive=True)
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _add_tenants(stack) -> list[dict[str, str]]:
    from app.gateway.tenants import TenantsFile

    path = stack.home / "tenants.yaml"
    doc = TenantsFile.read(path)
    keys = [doc.add_key(f"rel-load-{i}", adapters=list(MODELS[:3]), max_concurrency=TENANT_LIMIT) for i in range(4)]
    doc.write(path)
    return [{"Authorization": f"Bearer {k}"} for k in keys]


def _one(stack, headers: dict, model: str, stream: bool) -> tuple[str, float, str | None]:
    """(outcome, seconds, problem): outcome ``ok``, ``429`` or ``503``."""
    body = {"model": model, "prompt": "load", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
    url = stack.base_url + "/v1/completions"
    t0 = time.monotonic()
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", url, headers=headers, json=body, timeout=300) as s:
            if s.status_code != 200:
                s.read()
                return _refusal(s, t0)
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        tokens = events[-1].get("usage", {}).get("completion_tokens") if events else None
        errors = [e for e in events if "error" in e]
    else:
        r = httpx.post(url, headers=headers, json=body, timeout=300)
        if r.status_code != 200:
            return _refusal(r, t0)
        tokens, errors = r.json()["usage"]["completion_tokens"], []
    ok = tokens == TOKENS and not errors
    return "ok", time.monotonic() - t0, None if ok else f"accepted but not completed: {tokens} tokens, {errors}"


def _refusal(r, t0: float) -> tuple[str, float, str | None]:
    status = r.status_code
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    deliberate = status in (429, 503) and r.headers.get("retry-after") and message
    return str(status), time.monotonic() - t0, None if deliberate else f"{status}: {r.text[:200]}"


def test_twice_the_capacity_only_deliberate_refusals_and_every_accepted_request_completes(serve_stack, stack_invariants):
    keys = _add_tenants(serve_stack)
    outcomes: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    problems: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + DURATION_S
    rss = [_stack_rss(serve_stack)]
    sampling = threading.Event()

    def sample():
        while not sampling.wait(1):
            rss.append(_stack_rss(serve_stack))

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            with lock:
                if sum(outcomes.values()) >= MAX_REQUESTS:
                    return
            outcome, seconds, problem = _one(serve_stack, keys[i % 4], MODELS[(i + n) % 4], stream=bool((i + n) % 2))
            n += 1
            with lock:
                outcomes[outcome] += 1
                if outcome == "ok":
                    latencies.append(seconds)
                if problem:
                    problems.append(problem)
            if outcome != "ok":
                time.sleep(0.2)  # a refused client backs off briefly (its Retry-After is >= 1 s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    wall = time.monotonic() - t0
    sampling.set()
    sampler.join(5)
    rss_after = _stack_rss(serve_stack)
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    print(f"\nload: {CLIENTS} clients, {wall:.1f} s, outcomes {dict(outcomes)}, "
          f"{outcomes['ok'] / wall:.1f} completions/s, latency p50 {pct(0.5):.3f} s p99 {pct(0.99):.3f} s "
          f"max {latencies[-1]:.3f} s; stack RSS before {rss[0] / 2**20:.0f} MiB, peak {max(rss) / 2**20:.0f} MiB, "
          f"after {rss_after / 2**20:.0f} MiB")
    assert problems == []
    assert set(outcomes) <= {"ok", "429", "503"} and outcomes["ok"] > 0
    assert stack_invariants() == []
