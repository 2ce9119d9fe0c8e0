"""Virtual token counters (VTC, S-LoRA's fair scheduler, arXiv 2401.00588) as start tags.

VTC serves, among tenants with work waiting, the one whose counter of weighted tokens served is
lowest. A static priority queue (vLLM's ``scheduling_policy="priority"``, the gateway's wait
queue) cannot re-rank requests while they wait, so each request gets, when admitted, the value
its tenant's counter will have when it is its turn (start-time fair queueing over VTC's
counters):

- tenant ``u`` has a counter ``F_u``: virtual tokens (tokens ÷ weight) of the work admitted for it;
- a request of ``u`` with estimated cost ``c`` tokens gets the tag ``S = max(V, F_u)`` and
  ``F_u`` becomes ``S + c / w_u``; lower tags are served first;
- ``V``, the virtual time, is the smallest tag among requests not yet finished (with none, the
  largest counter): lifting a returning tenant to ``V`` is VTC's counter lift, so idleness banks
  no credit;
- when a request finishes, its estimate is replaced by the tokens really served (prompt +
  output), so counters count service.

Invariants: one tenant's tags grow in admission order (its own requests stay first come, first
served); ``V`` never decreases; every new tag is at least ``V``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKGROUND_WEIGHT = 0.25  # weight of a tenant of priority 0


def weight_of(priority: int) -> float:
    """A tenant's share weight from its ``priority`` (0 counts as ``BACKGROUND_WEIGHT``)."""
    return float(priority) if priority > 0 else BACKGROUND_WEIGHT


@dataclass
class Ticket:
    """One admitted request: its tenant, weight, tag, the cost charged so far, and how far the
    tenant's counter was ahead of the virtual time once it was admitted (its backlog)."""

    tenant: str
    weight: float
    tag: float
    charged_tokens: int
    backlog: float = 0.0
    done: bool = False


@dataclass
class VirtualTokenCounters:
    """Per-tenant counters and the virtual time of one scheduling point (a gateway replica's
    wait queue, or one engine replica's batch)."""

    counters: dict[str, float] = field(default_factory=dict)
    active: dict[int, Ticket] = field(default_factory=dict)
    virtual_time: float = 0.0

    def admit(self, tenant: str, weight: float, estimated_tokens: int) -> Ticket:
        """Tags a new request of ``tenant`` costing about ``estimated_tokens``."""
        if weight <= 0:
            raise ValueError("weight must be positive")
        self._advance()
        tag = max(self.virtual_time, self.counters.get(tenant, 0.0))
        cost = max(0, int(estimated_tokens))
        self.counters[tenant] = tag + cost / weight
        ticket = Ticket(tenant, weight, tag, cost, backlog=self.counters[tenant] - self.virtual_time)
        self.active[id(ticket)] = ticket
        return ticket

    def finish(self, ticket: Ticket, served_tokens: int | None = None) -> None:
        """The request ended; ``served_tokens`` (prompt + output, when known) replaces its
        estimate in the tenant's counter. Idempotent."""
        if ticket.done:
            return
        ticket.done = True
        self.active.pop(id(ticket), None)
        if served_tokens is not None:
            delta = (int(served_tokens) - ticket.charged_tokens) / ticket.weight
            floor = self.virtual_time  # a refund never takes a counter below the virtual time
            self.counters[ticket.tenant] = max(floor, self.counters.get(ticket.tenant, 0.0) + delta)
        self._advance()

    def _advance(self) -> None:
        if self.active:
            low = min(t.tag for t in self.active.values())
        else:
            low = max(self.counters.values(), default=self.virtual_time)
        self.virtual_time = max(self.virtual_time, low)

    def snapshot(self) -> dict[str, float]:
        """Counters relative to the virtual time (what each tenant is ahead by), for operators."""
        return {t: round(c - self.virtual_time, 1) for t, c in sorted(self.counters.items())}
