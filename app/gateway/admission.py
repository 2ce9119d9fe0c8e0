"""Admission: per-tenant concurrency limits and token budgets (429 with Retry-After), and a
global in-flight bound per gateway replica (503 with Retry-After) so overload sheds load early
instead of queueing without bound.

``Admission.admit(tenant, estimated_tokens)`` is an async context manager held for a request's
lifetime. Budgets are a token bucket per tenant refilled continuously at ``tokens_per_minute``;
a request is charged its prompt estimate plus ``max_tokens`` up front.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from app.errors import Overloaded, RateLimited
from app.gateway.tenants import Tenant


@dataclass
class _TenantState:
    in_flight: int = 0
    tokens: float = 0.0
    updated: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(self, max_in_flight: int | None = None) -> None:
        self._state: dict[str, _TenantState] = {}
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def _bucket(self, tenant: Tenant) -> _TenantState:
        st = self._state.get(tenant.name)
        if st is None:
            st = self._state[tenant.name] = _TenantState(tokens=float(tenant.tokens_per_minute or 0))
        if tenant.tokens_per_minute:
            now = time.monotonic()
            rate = tenant.tokens_per_minute / 60.0
            st.tokens = min(float(tenant.tokens_per_minute), st.tokens + (now - st.updated) * rate)
            st.updated = now
        return st

    @asynccontextmanager
    async def admit(self, tenant: Tenant, estimated_tokens: int):
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise Overloaded(f"the service is at capacity ({self.in_flight} requests in flight); retry shortly", retry_after_s=1.0,
                             reason="gateway_capacity")
        st = self._bucket(tenant)
        if st.in_flight >= tenant.max_concurrency:
            raise RateLimited(
                f"tenant {tenant.name!r} has {st.in_flight} requests in flight (limit {tenant.max_concurrency}); retry later",
                retry_after_s=1.0, reason="concurrency",
            )
        if tenant.tokens_per_minute:
            if estimated_tokens > tenant.tokens_per_minute:
                raise RateLimited(
                    f"request needs ~{estimated_tokens} tokens, above the tenant's budget of "
                    f"{tenant.tokens_per_minute} per minute: lower max_tokens or the prompt", reason="request_too_large",
                )
            if st.tokens < estimated_tokens:
                wait = (estimated_tokens - st.tokens) / (tenant.tokens_per_minute / 60.0)
                raise RateLimited(f"tenant {tenant.name!r} token budget exhausted; retry later", retry_after_s=wait,
                                  reason="token_budget")
            st.tokens -= estimated_tokens
        st.in_flight += 1
        self.in_flight += 1
        try:
            yield
        finally:
            st.in_flight -= 1
            self.in_flight -= 1
