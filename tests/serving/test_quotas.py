"""Cluster-wide quotas: the ledger's book, and gateway replicas' leases of it (two replicas
sharing one ledger in this process; ``test_quota_ledger_ray`` runs it in Ray actors)."""

from __future__ import annotations

import asyncio

import pytest

from app.errors import RateLimited
from app.gateway.quota_book import Holding, LeaseRequest, Limits, QuotaBook
from app.gateway.quota_ledger import LocalLedger
from app.gateway.quotas import TenantQuotas
from app.gateway.tenants import Tenant
from tests.helpers.aio import asynctest


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ask(gw: str, slots: int = 0, tokens: int = 0, cap: int = 2, tpm: int | None = 600) -> LeaseRequest:
    return LeaseRequest(gateway=gw, tenant="acme", limits=Limits(max_concurrency=cap, tokens_per_minute=tpm),
                        slots=slots, tokens=tokens)


def test_slots_leased_over_gateways_never_exceed_the_cap_and_a_dead_gateways_come_back():
    clock = Clock()
    book = QuotaBook(lease_ttl_s=10, clock=clock)
    assert book.acquire(ask("g1", slots=1)).slots == 1
    assert book.acquire(ask("g2", slots=1)).slots == 1
    assert book.acquire(ask("g2", slots=1)).slots == 0  # cap 2 reached
    clock.t += 5
    book.sync("g2", [Holding(tenant="acme", limits=ask("g2").limits, held_slots=1)])
    clock.t += 6  # g1 silent for 11 s: presumed dead
    assert book.acquire(ask("g2", slots=1)).slots == 1
    assert book.snapshot()["acme"]["held"] == {"g2": 2}


def test_tokens_are_leased_from_one_bucket():
    clock = Clock()
    book = QuotaBook(token_lease_fraction=0.1, clock=clock)
    first = book.acquire(ask("g1", tokens=10))
    assert first.tokens == 60  # a lease: a tenth of the per-minute budget
    assert book.acquire(ask("g2", tokens=500)).tokens == 500  # what it asked (more than a lease)
    refused = book.acquire(ask("g1", tokens=100))  # 40 left
    assert refused.tokens == 0 and refused.retry_after_s == pytest.approx(6.0)  # 60 more at 10/s
    clock.t += 10
    assert book.acquire(ask("g1", tokens=100)).tokens == 100
    book.sync("g1", [Holding(tenant="acme", limits=ask("g1").limits, held_slots=0, release_tokens=50)])
    assert book.snapshot()["acme"]["tokens_left"] == 90


def test_a_restarted_ledger_relearns_the_slots_in_use_from_the_syncs():
    book = QuotaBook()
    book.acquire(ask("g1", slots=2))
    fresh = QuotaBook()  # state lost
    fresh.sync("g1", [Holding(tenant="acme", limits=ask("g1").limits, held_slots=2)])
    assert fresh.acquire(ask("g2", slots=1)).slots == 0


def test_a_refusal_recalls_the_other_gateways_unused_leases():
    book = QuotaBook()
    book.acquire(ask("g1", slots=2))
    assert book.sync("g1", [Holding(tenant="acme", limits=ask("g1").limits, held_slots=2)]).recall == []
    assert book.acquire(ask("g2", slots=1)).slots == 0
    assert book.sync("g1", [Holding(tenant="acme", limits=ask("g1").limits, held_slots=2)]).recall == ["acme"]
    book.sync("g1", [Holding(tenant="acme", limits=ask("g1").limits, held_slots=1, release_slots=1)])
    assert book.acquire(ask("g2", slots=1)).slots == 1


def two_gateways(**kw) -> tuple[TenantQuotas, TenantQuotas]:
    ledger = LocalLedger(QuotaBook(token_lease_fraction=1 / 32))
    return (TenantQuotas(ledger, "g1", sync_interval_s=0.02, **kw),
            TenantQuotas(ledger, "g2", sync_interval_s=0.02, **kw))


@asynctest
async def test_a_budget_holds_across_two_gateways():
    g1, g2 = two_gateways()
    tenant = Tenant(name="acme", tokens_per_minute=6000)
    admitted = 0
    for i in range(400):
        try:
            await (g1 if i % 2 else g2).take_tokens(tenant, 50)
            admitted += 50
        except RateLimited as exc:
            assert exc.retry_after_s > 0
    # the bucket's 6000 plus what it refilled while the loop ran (100 tokens/s), nothing more
    assert 6000 * 0.9 <= admitted <= 6000 + 100, admitted


@asynctest
async def test_a_concurrency_cap_holds_across_two_gateways_and_a_waiter_gets_a_slot_freed_on_the_other():
    g1, g2 = two_gateways(spare_idle_s=30)
    tenant = Tenant(name="acme", max_concurrency=2)
    await g1.acquire_slot(tenant, 0)
    await g2.acquire_slot(tenant, 0)
    with pytest.raises(RateLimited, match="in flight"):
        await g1.acquire_slot(tenant, 0)
    waiter = asyncio.create_task(g1.acquire_slot(tenant, wait_s=3))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    g2.release_slot(tenant)  # kept by g2 as a spare until the ledger recalls it for g1
    await asyncio.wait_for(waiter, 2)
    assert g1.held("acme")["in_use"] == 2 and g2.held("acme")["held"] == 0


@asynctest
async def test_steady_traffic_makes_no_ledger_call_per_request():
    class CountingLedger(LocalLedger):
        acquires = 0

        async def acquire(self, req):
            CountingLedger.acquires += 1
            return await super().acquire(req)

    quotas = TenantQuotas(CountingLedger(), "g1", sync_interval_s=0.05)
    tenant = Tenant(name="acme", max_concurrency=4, tokens_per_minute=64_000)
    for _ in range(200):
        await quotas.take_tokens(tenant, 20)
        await quotas.acquire_slot(tenant, 0)
        quotas.release_slot(tenant)
    assert CountingLedger.acquires <= 3  # one slot lease, token leases of 2000 (1/32 of the budget)


@asynctest
async def test_a_request_after_a_pause_waits_on_one_ledger_call_for_its_tokens_and_slot():
    """Tokens and the slot come in one call when neither is leased here (the first request, or
    the first after the tenant's lease went back); a spare left here needs none."""
    class CountingLedger(LocalLedger):
        acquires = 0

        async def acquire(self, req):
            CountingLedger.acquires += 1
            return await super().acquire(req)

    quotas = TenantQuotas(CountingLedger(), "g1", sync_interval_s=0.01, spare_idle_s=0.05)
    tenant = Tenant(name="acme", max_concurrency=4, tokens_per_minute=64_000)

    async def one_request() -> None:
        await quotas.take_tokens(tenant, 3000)  # above one token lease: a call each time
        await quotas.acquire_slot(tenant, 0)
        quotas.release_slot(tenant)

    await one_request()
    assert CountingLedger.acquires == 1 and quotas.held("acme")["held"] == 1
    for _ in range(100):  # idle past spare_idle_s: the sync gives the slot and tokens back
        await asyncio.sleep(0.02)
        if not quotas.held("acme").get("held"):
            break
    assert not quotas.held("acme").get("held")
    await one_request()
    assert CountingLedger.acquires == 2


@asynctest
async def test_a_slot_leased_while_requests_wait_goes_to_the_first_of_them():
    """A request's tokens-and-slot call can return after others started waiting at the cap: the
    slot it brings goes to the first waiter at once, not left spare until a release (the waiters'
    own polls come every 2 x sync_interval_s, here 2 s)."""
    class SlowFirstReply(LocalLedger):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.calls = asyncio.Event(), 0

        async def acquire(self, req):
            self.calls += 1
            grant = await super().acquire(req)
            if self.calls == 1:
                await self.gate.wait()  # the ledger decided; its reply is late
            return grant

    ledger = SlowFirstReply()
    quotas = TenantQuotas(ledger, "g1", sync_interval_s=1.0)
    tenant = Tenant(name="acme", max_concurrency=1, tokens_per_minute=64_000)

    async def admitted(name: str) -> str:
        await quotas.take_tokens(tenant, 10)
        await quotas.acquire_slot(tenant, wait_s=5)
        return name

    first = asyncio.create_task(admitted("first"))  # its call takes the only slot, replies late
    await asyncio.sleep(0.05)
    second = asyncio.create_task(admitted("second"))  # tokens come, the slot is refused: waits
    await asyncio.sleep(0.05)
    assert not second.done() and quotas.held("acme")["held"] == 0
    ledger.gate.set()
    done, _ = await asyncio.wait({first, second}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result() for t in done] == ["second"]  # it waited first; "first" now waits behind it
    held = quotas.held("acme")
    assert (held["held"], held["in_use"]) == (1, 1)  # the cap: one slot, in use
    first.cancel()
