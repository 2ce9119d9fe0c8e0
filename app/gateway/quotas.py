"""A gateway replica's leases of the cluster-wide tenant quotas (``app.gateway.quota_book``).

Per tenant the replica holds concurrency slots and a token allowance leased from the ledger.
A request takes its tokens and a slot from the lease; only when the lease has run out does it
wait on the ledger (one remote call per lease, not per request; tokens and a slot in one call).
A slot freed by a request stays leased here (the next request needs no call) until the tenant
has been idle here for ``spare_idle_s`` or the ledger recalls it because another replica was
refused; unspent tokens go back the same way. A background task syncs with the ledger every
``sync_interval_s`` while anything is held (this is also the lease's heartbeat).

A tenant at its concurrency cap waits for a slot up to ``wait_s`` (first come, first served
among its requests, at most ``max_waiting`` of them: a slot released or leased while they wait
goes to the first of them) before ``RateLimited`` (429); an exhausted budget is ``RateLimited``
at once, with ``Retry-After`` from the ledger's bucket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from app.errors import RateLimited
from app.gateway.quota_book import Holding, LeaseRequest, Limits
from app.gateway.tenants import Tenant

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    limits: Limits
    held: int = 0
    in_use: int = 0
    tokens: int = 0
    last_active: float = field(default_factory=time.monotonic)
    release_slots: int = 0
    release_tokens: int = 0
    waiters: deque = field(default_factory=deque)

    def live_waiters(self) -> int:
        return sum(1 for f in self.waiters if not f.done())


def limits_of(tenant: Tenant) -> Limits:
    return Limits(max_concurrency=tenant.max_concurrency, tokens_per_minute=tenant.tokens_per_minute)


class TenantQuotas:
    def __init__(self, ledger, gateway_id: str, sync_interval_s: float = 0.1, spare_idle_s: float = 30.0,
                 max_waiting: int = 64) -> None:
        self.ledger = ledger
        self.gateway_id = gateway_id
        self.sync_interval_s = sync_interval_s
        self.spare_idle_s = spare_idle_s
        self.max_waiting = max_waiting
        self._leases: dict[str, _Lease] = {}
        self._recalled: set[str] = set()
        self._sync_task: asyncio.Task | None = None

    def _lease(self, tenant: Tenant) -> _Lease:
        lease = self._leases.get(tenant.name)
        if lease is None:
            lease = self._leases[tenant.name] = _Lease(limits_of(tenant))
        lease.limits = limits_of(tenant)  # the tenants file may have changed
        lease.last_active = time.monotonic()
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_forever())
        return lease

    # ---- tokens --------------------------------------------------------------------------------
    async def take_tokens(self, tenant: Tenant, n: int) -> None:
        """Charges ``n`` tokens to the tenant's budget, or raises ``RateLimited``."""
        tpm = tenant.tokens_per_minute
        if not tpm:
            return
        if n > tpm:
            raise RateLimited(f"request needs ~{n} tokens, above the tenant's budget of {tpm} per minute: "
                              "lower max_tokens or the prompt", reason="request_too_large")
        lease = self._lease(tenant)
        if lease.tokens < n:
            # The slot this request takes next comes in the same call when none is spare here.
            slot = 1 if lease.in_use >= lease.held and not lease.live_waiters() else 0
            grant = await self.ledger.acquire(LeaseRequest(gateway=self.gateway_id, tenant=tenant.name,
                                                           limits=lease.limits, tokens=n - lease.tokens,
                                                           slots=slot))
            lease.held += grant.slots  # a spare until acquire_slot takes it
            self._serve_waiters(lease)  # unless a request that came meanwhile waits for one
            lease.tokens += grant.tokens
            if lease.tokens < n:
                raise RateLimited(f"tenant {tenant.name!r} token budget exhausted; retry later",
                                  retry_after_s=grant.retry_after_s or 1.0, reason="token_budget")
        lease.tokens -= n

    def refund_tokens(self, tenant: Tenant, n: int) -> None:
        """Gives back tokens charged to a request that was not served."""
        if tenant.tokens_per_minute and tenant.name in self._leases:
            self._leases[tenant.name].tokens += n

    # ---- concurrency ---------------------------------------------------------------------------
    async def acquire_slot(self, tenant: Tenant, wait_s: float) -> None:
        """Takes one of the tenant's concurrency slots, waiting up to ``wait_s``; else ``RateLimited``."""
        lease = self._lease(tenant)
        deadline = time.monotonic() + wait_s
        while True:
            self._serve_waiters(lease)
            if lease.in_use < lease.held and not lease.live_waiters():
                lease.in_use += 1
                return
            grant = await self.ledger.acquire(LeaseRequest(gateway=self.gateway_id, tenant=tenant.name,
                                                           limits=lease.limits, slots=1))
            if grant.slots:
                lease.held += grant.slots
                if lease.live_waiters():  # they came first: this one queues behind them
                    self._serve_waiters(lease)
                else:
                    lease.in_use += 1
                    return
            left = deadline - time.monotonic()
            if left <= 0 or lease.live_waiters() >= self.max_waiting:
                raise RateLimited(
                    f"tenant {tenant.name!r} is at its limit of {lease.limits.max_concurrency} requests in flight "
                    "(counted over all gateway replicas); retry later", retry_after_s=1.0,
                    reason="concurrency")
            if await self._wait_for_release(lease, min(left, 2 * self.sync_interval_s)):
                return  # a release here handed its slot over

    async def _wait_for_release(self, lease: _Lease, within_s: float) -> bool:
        fut = asyncio.get_running_loop().create_future()
        lease.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), within_s)
            return True
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return True
            fut.cancel()
            return False
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._hand_over_or_free(lease)
            else:
                fut.cancel()
            raise
        finally:
            while lease.waiters and lease.waiters[0].done():
                lease.waiters.popleft()

    def release_slot(self, tenant: Tenant) -> None:
        lease = self._leases.get(tenant.name)
        if lease is not None:
            lease.last_active = time.monotonic()
            self._hand_over_or_free(lease)

    @staticmethod
    def _serve_waiters(lease: _Lease) -> None:
        """Spare slots (leased, unused) go to the waiting requests first, in arrival order."""
        while lease.in_use < lease.held and lease.waiters:
            fut = lease.waiters.popleft()
            if not fut.done():
                lease.in_use += 1
                fut.set_result(True)

    @staticmethod
    def _hand_over_or_free(lease: _Lease) -> None:
        while lease.waiters:
            fut = lease.waiters.popleft()
            if not fut.done():
                fut.set_result(True)  # the slot passes to the waiter
                return
        lease.in_use -= 1  # stays leased here as a spare

    # ---- sync with the ledger ------------------------------------------------------------------
    def _give_back(self, now: float) -> None:
        for name, lease in self._leases.items():
            idle = now - lease.last_active > self.spare_idle_s
            if (idle or name in self._recalled) and not lease.live_waiters():
                spare = lease.held - lease.in_use
                lease.held -= spare
                lease.release_slots += spare
                lease.release_tokens += lease.tokens
                lease.tokens = 0

    async def sync_once(self) -> None:
        """One exchange with the ledger: releases, holdings (heartbeat), recalls."""
        now = time.monotonic()
        self._give_back(now)
        holdings = [Holding(tenant=name, limits=lease.limits, held_slots=lease.held,
                            release_slots=lease.release_slots, release_tokens=lease.release_tokens)
                    for name, lease in self._leases.items()
                    if lease.held or lease.release_slots or lease.release_tokens]
        if not holdings:
            self._recalled = set()
            return
        reply = await self.ledger.sync(self.gateway_id, holdings)
        for h in holdings:  # sent: not again
            lease = self._leases[h.tenant]
            lease.release_slots -= h.release_slots
            lease.release_tokens -= h.release_tokens
        self._recalled = set(reply.recall)
        for name in [n for n, lease in self._leases.items()
                     if not (lease.held or lease.in_use or lease.tokens or lease.waiters)
                     and now - lease.last_active > self.spare_idle_s]:
            del self._leases[name]

    async def _sync_forever(self) -> None:
        while True:
            try:
                await self.sync_once()
                if self._recalled:
                    await self.sync_once()  # give back what was recalled now, not a period later
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the leases; the next sync resends the releases
                logger.warning("quota sync failed: %s", exc)
            await asyncio.sleep(self.sync_interval_s)

    def held(self, tenant: str) -> dict[str, int]:
        lease = self._leases.get(tenant)
        return {} if lease is None else {"held": lease.held, "in_use": lease.in_use, "tokens": lease.tokens}
