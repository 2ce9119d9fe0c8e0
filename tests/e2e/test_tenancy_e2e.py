"""Tenancy under contention on the real stack: 2 engine replicas, 2 gateway replicas.

The stack is ``benchmarks.fairness``'s: engines of ``max_num_seqs`` 3 (6 batch slots for the
flood's 8 streams) and vLLM's ``stream_interval`` 8 for every stream (the first token still goes
out at once), so the engines' batches are what requests wait for, as on a GPU host — with
per-token streaming this 2-core machine is busy relaying the flood's chunks instead (figures of
both in benchmarks/RESULTS.md, section fairness).
"""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks import fairness
from benchmarks.loadgen.contention import GATEWAY_HEADER

pytestmark = pytest.mark.e2e
METERED_TPM = 3000


@pytest.fixture(scope="module")
def tenancy_stack(loraplex_home, tmp_path_factory):
    """A stack of its own (its own LORAPLEX_HOME: its processes and tenants file are its own)."""
    from app.embedded.setup import init
    from app.gateway.tenants import TenantsFile
    from tests.helpers.stack import start_stack, stop_stack, wait_for_engine_replicas

    home = tmp_path_factory.mktemp("tenancy-home")
    shutil.copytree(loraplex_home / "models", home / "models")
    init(home, progress=False)
    keys = fairness.add_tenants(home / "tenants.yaml")
    doc = TenantsFile.read(home / "tenants.yaml")
    keys["metered"] = doc.add_key("metered", tokens_per_minute=METERED_TPM, max_concurrency=64)
    doc.write(home / "tenants.yaml")
    stack = start_stack(home, tmp_path_factory.mktemp("tenancy-stack"), args_update=fairness.stack_args(8))
    stack.keys.update(keys)
    try:
        wait_for_engine_replicas(stack, 2)  # measured with both engine replicas serving
    except BaseException:
        stop_stack(stack)
        raise
    yield stack
    stop_stack(stack)


def test_a_polite_tenant_keeps_its_latency_while_another_floods(tenancy_stack):
    """Measured in one run (``benchmarks.fairness``'s phases): the polite tenant's TTFT alone
    (30 requests, one at a time, before and after the floods), under a flood of 8 long streams
    with fair share (30 requests), and under the same flood first come, first served (15).
    With fair share its median TTFT stays within a small multiple of its median alone, every
    probe is served, and the flood keeps the capacity the polite tenant leaves: its token rate
    while the probes run is most of its rate alone. The issue's figures (p99 within 2× alone, and
    the first-come-first-served phase for contrast) are timings, reported, not asserted:
    ``python -m benchmarks.fairness`` prints them and ``benchmarks/RESULTS.md`` records them."""
    stack = tenancy_stack
    spec = fairness.FairnessSpec()
    with fairness.client_priority():
        phases = asyncio.run(fairness.run_phases(stack.base_url, stack.keys, stack.home / "tenants.yaml", spec,
                                                 log=lambda *_: None))
    by = {p.name: p for p in phases}
    fair, fcfs = by["flood, fair share on"], by["flood, fair share off"]
    alone = fairness.summarise(by["alone"].ttfts_ms + by["alone, again"].ttfts_ms)
    report = "\n".join(f"{p.name}: {p.ttft_ms}, flood {p.flood_alone_tokens_per_s} / {p.flood_tokens_per_s} tok/s"
                       for p in phases)
    print("\nfairness phases:\n" + report)  # the figures (pytest -s shows them)
    assert all(p.probe_failures == 0 for p in phases), report
    assert fair.ttft_ms.p50 <= 3 * alone.p50, report
    assert fair.flood_tokens_per_s >= 0.6 * fair.flood_alone_tokens_per_s, report  # work-conserving
    gateways = set(fair.gateways) | set(fcfs.gateways)
    assert len(gateways) == 2, f"both gateway replicas should have served: {gateways}"


def test_a_token_budget_holds_across_both_gateway_replicas(tenancy_stack):
    """A tenant with 3000 tokens a minute sends 400 requests of ~100 tokens each (the gateway's
    charge: prompt estimate + max_tokens; a long prompt and 2 output tokens, so the demand is
    far above the bucket and its refill however slowly the host serves) from 8 clients; both
    gateway replicas answer (header), and the tokens admitted stay within 10% of the bucket plus
    what it refilled meanwhile."""
    from app.gateway.ingress import _estimate_tokens
    from app.gateway.openai_bodies import GatewayFields

    stack = tenancy_stack
    body = {"model": "loraplex-base", "prompt": "tok " * 100, "max_tokens": 2}
    cost = _estimate_tokens(body, GatewayFields.of(body))
    url = stack.base_url + "/v1/completions"
    headers = stack.headers("metered")

    def send(_):
        r = httpx.post(url, headers=headers, json=body, timeout=120)
        return r.status_code, r.headers.get(GATEWAY_HEADER), r.headers.get("retry-after")

    import time

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(400)))
    elapsed = time.monotonic() - t0
    admitted = sum(cost for status, *_ in answers if status == 200)
    allowed = METERED_TPM + elapsed * METERED_TPM / 60
    refused = [a for a in answers if a[0] == 429]
    print(f"\nbudget: admitted {admitted} tokens, allowed {allowed:.0f} in {elapsed:.1f} s, {len(refused)} refused")
    assert {s for s, *_ in answers} <= {200, 429}, answers
    assert refused and all(retry for *_, retry in refused)
    assert 0.9 * METERED_TPM <= admitted <= 1.1 * allowed, (admitted, allowed, elapsed)
    served_by = {g for s, g, _ in answers if s == 200}
    assert len(served_by) == 2, f"both gateway replicas should have admitted requests: {served_by}"
