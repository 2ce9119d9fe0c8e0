"""Admission: a request's tenant budget, tenant concurrency and a dispatch slot of this gateway
replica, held for the request's lifetime.

``Admission.admit(tenant, estimated_tokens, fair)`` is an async context manager:

1. tokens: the prompt estimate plus ``max_tokens``, charged up front to the tenant's budget,
   which all gateway replicas share (``app.gateway.quotas``: leases from the quota ledger);
   exhausted → 429 with ``Retry-After``;
2. a concurrency slot of the tenant (also cluster-wide), waiting up to ``tenant_wait_s`` at the
   cap (429 after);
3. a dispatch slot of this replica (``app.gateway.fairness``: ``max_in_flight`` of them, waited
   for up to ``dispatch_wait_s`` in fair-share order when ``fair`` — else in arrival order — 503
   after).

Tokens of a request refused at step 2 or 3 are given back.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from app.config import AppConfig
from app.gateway.fairness import FairQueue
from app.gateway.quota_ledger import LocalLedger, RayLedger
from app.gateway.quotas import TenantQuotas
from app.gateway.tenants import Tenant
from app.vtc import weight_of

FIFO_WEIGHT_TENANT = "-"  # with fair share off every request counts as one tenant's: arrival order


class Admission:
    def __init__(self, quotas: TenantQuotas, queue: FairQueue, tenant_wait_s: float = 0.0) -> None:
        self.quotas = quotas
        self.queue = queue
        self.tenant_wait_s = tenant_wait_s

    @classmethod
    def local(cls, max_in_flight: int | None = None, tenant_wait_s: float = 0.0,
              dispatch_wait_s: float = 0.0) -> Admission:
        """Admission of one process without Ray (the quota ledger in this process)."""
        return cls(TenantQuotas(LocalLedger(), "local"), FairQueue(max_in_flight, wait_s=dispatch_wait_s),
                   tenant_wait_s)

    @property
    def in_flight(self) -> int:
        return self.queue.in_use

    @asynccontextmanager
    async def admit(self, tenant: Tenant, estimated_tokens: int, fair: bool = True):
        await self.quotas.take_tokens(tenant, estimated_tokens)
        try:
            await self.quotas.acquire_slot(tenant, self.tenant_wait_s)
        except BaseException:
            self.quotas.refund_tokens(tenant, estimated_tokens)
            raise
        try:
            name, weight = (tenant.name, weight_of(tenant.priority)) if fair else (FIFO_WEIGHT_TENANT, 1.0)
            entered = False
            async with self.queue.slot(name, weight, estimated_tokens):
                entered = True
                yield
        except BaseException:
            if not entered:
                self.quotas.refund_tokens(tenant, estimated_tokens)
            raise
        finally:
            self.quotas.release_slot(tenant)


def build_admission(cfg: AppConfig, gateway_id: str, ledger_name: str | None) -> Admission:
    """The admission of one gateway replica: leases from the ledger ``ledger_name`` (Ray actors
    shared by the replicas of one app; None: a ledger in this process)."""
    t = cfg.tenancy
    ledger = (RayLedger(ledger_name, t.quota_shards, t.quota_lease_ttl_s, t.token_lease_fraction)
              if ledger_name else LocalLedger())
    quotas = TenantQuotas(ledger, gateway_id, t.quota_sync_interval_s, t.spare_idle_s, t.max_waiting_per_tenant)
    queue = FairQueue(cfg.max_in_flight_per_gateway, t.max_waiting_per_gateway, t.dispatch_wait_s)
    return Admission(quotas, queue, t.tenant_wait_s)
