"""The quota ledger's state: per tenant, a cluster-wide token bucket and concurrency cap, leased
out to gateway replicas (pure, Ray-free; ``app.gateway.quota_ledger`` runs it in Ray actors).

Gateways admit requests against leases they hold, so the request path makes no remote call
while a lease lasts: a lease of concurrency slots (kept while the tenant is active there) and an
allowance of tokens carved from the bucket (a fraction of the per-minute budget at a time).

Invariants: the slots leased for a tenant, summed over gateways, never exceed its
``max_concurrency``, and the tokens leased never exceed what its bucket held (capacity
``tokens_per_minute``, refilled continuously), so a budget cannot be exceeded however many
gateways admit against it. Tokens are charged when leased: a gateway that dies with an unspent
allowance loses it (never over-admits). A gateway not heard from for ``lease_ttl_s`` is presumed
dead and its slots return to the pool; a gateway reports what it holds at every sync, so a
ledger that restarted (state lost) relearns the slots in use. Calls of one gateway reach its
shard in the order it made them (a Ray actor runs one caller's calls in order), so releases
are counted as deltas. When a gateway is refused, the
others are asked, at their next sync, to return what they hold unused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

RECALL_S = 2.0  # how long a refusal keeps asking the other gateways to return unused leases


class Limits(BaseModel):
    """A tenant's limits as the tenants file says (the ledger keeps the latest it was sent)."""

    max_concurrency: int = Field(ge=1, description="Requests in flight at once, cluster-wide.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Token budget per minute, cluster-wide; None: unlimited.")


class LeaseRequest(BaseModel):
    """A gateway asks for more slots and/or tokens of one tenant (its own lease ran out)."""

    gateway: str = Field(description="The asking gateway replica's id.")
    tenant: str = Field(description="Tenant name.")
    limits: Limits = Field(description="The tenant's limits as this gateway read them.")
    slots: int = Field(0, ge=0, description="Concurrency slots wanted.")
    tokens: int = Field(0, ge=0, description="Tokens wanted at least (the grant may be larger: a lease).")


class LeaseGrant(BaseModel):
    """What the ledger leased to the gateway."""

    slots: int = Field(ge=0, description="Slots granted (all wanted or none).")
    tokens: int = Field(ge=0, description="Tokens granted (0, or at least those wanted).")
    retry_after_s: float | None = Field(None, description="When tokens were refused: seconds until the bucket holds enough.")


class Holding(BaseModel):
    """A gateway's report on one tenant at a sync."""

    tenant: str = Field(description="Tenant name.")
    limits: Limits = Field(description="The tenant's limits as this gateway read them.")
    held_slots: int = Field(ge=0, description="Slots the gateway holds after the releases below.")
    release_slots: int = Field(0, ge=0, description="Slots given back since the last sync.")
    release_tokens: int = Field(0, ge=0, description="Unspent tokens given back since the last sync.")


class SyncReply(BaseModel):
    """The ledger's answer to a sync."""

    recall: list[str] = Field(default_factory=list, description="Tenants whose unused slots and tokens to give back now.")


@dataclass
class _TenantBook:
    limits: Limits
    held: dict[str, int] = field(default_factory=dict)
    level: float = 0.0
    updated: float = 0.0
    recall_until: float = 0.0

    def refill(self, now: float) -> None:
        tpm = self.limits.tokens_per_minute
        if tpm:
            self.level = min(float(tpm), self.level + (now - self.updated) * tpm / 60.0)
        self.updated = now


class QuotaBook:
    """Leases of one shard of tenants (see the module doc)."""

    def __init__(self, lease_ttl_s: float = 10.0, token_lease_fraction: float = 1 / 32,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.token_lease_fraction = token_lease_fraction
        self.clock = clock
        self._tenants: dict[str, _TenantBook] = {}
        self._seen: dict[str, float] = {}

    def _book(self, tenant: str, limits: Limits, now: float) -> _TenantBook:
        book = self._tenants.get(tenant)
        if book is None:
            book = self._tenants[tenant] = _TenantBook(limits, level=float(limits.tokens_per_minute or 0), updated=now)
        book.refill(now)
        if limits != book.limits:
            book.limits = limits
            book.level = min(book.level, float(limits.tokens_per_minute or 0))
        return book

    def _heard_from(self, gateway: str, now: float) -> None:
        self._seen[gateway] = now
        dead = [g for g, t in self._seen.items() if now - t > self.lease_ttl_s]
        for g in dead:
            del self._seen[g]
            for book in self._tenants.values():
                book.held.pop(g, None)

    def acquire(self, req: LeaseRequest) -> LeaseGrant:
        now = self.clock()
        self._heard_from(req.gateway, now)
        book = self._book(req.tenant, req.limits, now)
        slots = 0
        if req.slots:
            free = book.limits.max_concurrency - sum(book.held.values())
            if free >= req.slots:
                slots = req.slots
                book.held[req.gateway] = book.held.get(req.gateway, 0) + slots
            else:
                book.recall_until = now + RECALL_S
        tokens, retry = 0, None
        tpm = book.limits.tokens_per_minute
        if req.tokens and tpm:
            if book.level >= req.tokens:
                tokens = int(min(book.level, max(req.tokens, tpm * self.token_lease_fraction)))
                book.level -= tokens
            else:
                retry = (req.tokens - book.level) / (tpm / 60.0)
                book.recall_until = now + RECALL_S
        return LeaseGrant(slots=slots, tokens=tokens, retry_after_s=retry)

    def sync(self, gateway: str, holdings: list[Holding]) -> SyncReply:
        now = self.clock()
        known = gateway in self._seen  # else this ledger restarted, or presumed the gateway dead
        self._heard_from(gateway, now)
        recall = []
        for h in holdings:
            book = self._book(h.tenant, h.limits, now)
            held = book.held.get(gateway, 0) - h.release_slots if known else h.held_slots
            if held > 0:
                book.held[gateway] = held
            else:
                book.held.pop(gateway, None)
            if h.release_tokens and book.limits.tokens_per_minute:
                book.level = min(float(book.limits.tokens_per_minute), book.level + h.release_tokens)
            if now < book.recall_until or sum(book.held.values()) > book.limits.max_concurrency:
                recall.append(h.tenant)
        return SyncReply(recall=recall)

    def snapshot(self) -> dict[str, dict]:
        """Per tenant: slots held per gateway, tokens left in the bucket (operators, tests)."""
        now = self.clock()
        out = {}
        for name, book in sorted(self._tenants.items()):
            book.refill(now)
            out[name] = {"held": dict(book.held), "tokens_left": int(book.level),
                         "limits": book.limits.model_dump()}
        return out
