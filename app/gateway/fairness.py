"""The gateway replica's dispatch slots, handed out in fair-share order when they run out.

``FairQueue(slots, max_waiting, wait_s)``: a request takes one of ``slots`` (None: unbounded)
for its lifetime. When all are taken it waits — at most ``wait_s`` seconds, behind at most
``max_waiting`` others — and freed slots go to the waiting request with the lowest VTC tag
(``app.vtc``: tenants' tokens admitted here, weighted), so a tenant flooding this replica waits
behind a polite tenant's new request instead of ahead of it. A full queue or an expired wait
raises ``Overloaded`` (503 with ``Retry-After``).

Invariant: ``in_use`` ≤ ``slots``; a freed slot passes straight to a waiter (never to a newcomer
while someone waits).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager

from app.errors import Overloaded
from app.vtc import VirtualTokenCounters


class FairQueue:
    def __init__(self, slots: int | None, max_waiting: int = 256, wait_s: float = 0.0) -> None:
        self.slots = slots
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self.in_use = 0
        self.counters = VirtualTokenCounters()
        self._waiting: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    @asynccontextmanager
    async def slot(self, tenant: str, weight: float, estimated_tokens: int):
        """Holds a dispatch slot for the body of the ``async with``."""
        ticket = self.counters.admit(tenant, weight, estimated_tokens)
        try:
            await self._acquire(ticket.tag)
        except BaseException:
            self.counters.finish(ticket)
            raise
        try:
            yield
        finally:
            self.counters.finish(ticket)
            self._release()

    async def _acquire(self, tag: float) -> None:
        if self.slots is None or (self.in_use < self.slots and not self._waiting):
            self.in_use += 1
            return
        if self.waiting >= self.max_waiting or self.wait_s <= 0:
            raise Overloaded(f"the service is at capacity ({self.in_use} requests in flight, {self.waiting} "
                             "waiting); retry shortly", retry_after_s=max(1.0, self.wait_s),
                             reason="gateway_capacity")
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (tag, next(self._order), fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # granted as the wait expired: keep it
                return
            fut.cancel()
            raise Overloaded(f"the service is at capacity: no slot freed within {self.wait_s:g} s; retry shortly",
                             retry_after_s=max(1.0, self.wait_s), reason="gateway_wait") from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()  # granted, then the caller went away
            else:
                fut.cancel()
            raise

    def _release(self) -> None:
        while self._waiting:
            *_, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(True)  # the slot passes to the waiter: in_use unchanged
                return
        self.in_use -= 1
