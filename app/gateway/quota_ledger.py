"""Where the quota ledger (``app.gateway.quota_book``) runs: one Ray actor per shard of tenants.

Every gateway replica finds the shards by name (``get_if_exists``), so all replicas share one
ledger; the actors are detached and restart on failure, so the ledger outlives any gateway
replica (a restarted replica finds the budgets as they were; a restarted shard relearns the
slots in use from the gateways' syncs, its buckets start full). Tenant → shard is a stable hash
of the name. ``LocalLedger`` runs the same book in the calling process, for a gateway without
Ray (one process: nothing to share).

Both offer ``acquire(LeaseRequest) -> LeaseGrant`` and ``sync(gateway, [Holding]) -> SyncReply``
as coroutines; a ledger that does not answer within ``timeout_s`` raises ``Overloaded`` (503).
"""

from __future__ import annotations

import asyncio
import zlib
from collections import defaultdict

from app.errors import Overloaded
from app.gateway.quota_book import (
    Holding,
    LeaseGrant,
    LeaseRequest,
    QuotaBook,
    SyncReply,
)

NAMESPACE = "loraplex"
TIMEOUT_S = 5.0


class QuotaShard:
    """The Ray actor of one shard (a synchronous actor: one call at a time, in order per caller)."""

    def __init__(self, lease_ttl_s: float, token_lease_fraction: float) -> None:
        self.book = QuotaBook(lease_ttl_s, token_lease_fraction)

    def acquire(self, req: LeaseRequest) -> LeaseGrant:
        return self.book.acquire(req)

    def sync(self, gateway: str, holdings: list[Holding]) -> SyncReply:
        return self.book.sync(gateway, holdings)

    def snapshot(self) -> dict[str, dict]:
        return self.book.snapshot()


def shard_of(tenant: str, shards: int) -> int:
    return zlib.crc32(tenant.encode()) % shards


class RayLedger:
    """The shards ``{name}-0`` … ``{name}-{shards-1}`` in Ray namespace ``loraplex``, created by
    whichever gateway replica asks first."""

    def __init__(self, name: str, shards: int, lease_ttl_s: float, token_lease_fraction: float,
                 timeout_s: float = TIMEOUT_S) -> None:
        import ray

        actor = ray.remote(QuotaShard)
        self.timeout_s = timeout_s
        self.actors = [
            actor.options(name=f"{name}-{i}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                          max_restarts=-1, max_task_retries=-1, num_cpus=0).remote(lease_ttl_s, token_lease_fraction)
            for i in range(shards)
        ]

    async def _call(self, ref):
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise Overloaded(f"the quota ledger did not answer ({type(exc).__name__}); retry shortly",
                             retry_after_s=1.0, reason="quota_ledger") from exc

    async def acquire(self, req: LeaseRequest) -> LeaseGrant:
        return await self._call(self.actors[shard_of(req.tenant, len(self.actors))].acquire.remote(req))

    async def sync(self, gateway: str, holdings: list[Holding]) -> SyncReply:
        by_shard: dict[int, list[Holding]] = defaultdict(list)
        for h in holdings:
            by_shard[shard_of(h.tenant, len(self.actors))].append(h)
        replies = await asyncio.gather(*(self._call(self.actors[i].sync.remote(gateway, hs))
                                         for i, hs in by_shard.items()))
        return SyncReply(recall=[t for r in replies for t in r.recall])

    async def snapshot(self) -> dict[str, dict]:
        parts = await asyncio.gather(*(self._call(a.snapshot.remote()) for a in self.actors))
        return {k: v for part in parts for k, v in part.items()}


class LocalLedger:
    """The book in this process (no Ray)."""

    def __init__(self, book: QuotaBook | None = None) -> None:
        self.book = book or QuotaBook()

    async def acquire(self, req: LeaseRequest) -> LeaseGrant:
        return self.book.acquire(req)

    async def sync(self, gateway: str, holdings: list[Holding]) -> SyncReply:
        return self.book.sync(gateway, holdings)

    async def snapshot(self) -> dict[str, dict]:
        return self.book.snapshot()
