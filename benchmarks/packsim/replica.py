"""One engine replica in the simulation: continuous batching, adapter slots, LRU, loads.

Model (its parameters from ``Calibration``):

- at most ``batch_capacity`` sequences decode together; with ``b`` of them every sequence gets
  one token per ``step(b)`` ms (vLLM's continuous batching as processor sharing);
- a request joins the batch when there is room and its adapter is registered; its first token
  comes ``first_token_ms + step(b) - step(1)`` after it joins (the prompt's prefill rides along
  in a step), the rest at the decode rate;
- waiting requests join first come, first served, skipping one whose adapter is loading or
  would make the batch hold more than ``max_loras`` distinct adapters (as vLLM's scheduler
  skips what it cannot schedule);
- a missing adapter loads into a free slot, or in place of the least recently used one no
  request uses (else the request waits): ``adapter_load_ms`` until it is registered, during
  which the replica's other sequences stall ``adapter_stall_ms`` (vLLM registers it between
  steps);
- a request that waited ``slot_timeout_s`` for a slot fails (loraplex's slot table answers 503
  after its ``acquire_timeout_s``);
- ``max_ongoing`` requests at most (Serve's ``max_ongoing_requests``); the rest wait upstream.

The base model's requests carry adapter None.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from benchmarks.packsim.calibration import Calibration

_order = itertools.count()


@dataclass(eq=False)
class Request:
    tenant: str
    adapter: str | None
    arrival: float
    output_tokens: int
    first_token: float | None = None
    done: float | None = None
    finish_at: float = 0.0  # replica progress (tokens per sequence) at which it completes
    loads: int = 0  # adapter loads it waited for
    admitted: float = 0.0
    failed: bool = False


@dataclass(eq=False)
class Replica:
    rid: str
    cal: Calibration
    max_ongoing: int
    started_at: float
    ready_at: float
    state: str = "starting"  # starting, running, draining, stopped
    stopped_at: float | None = None
    batch: list = field(default_factory=list)  # heap of (finish_at, order, request)
    waiting: deque = field(default_factory=deque)
    resident: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, least recent first
    loading: dict = field(default_factory=dict)  # adapter -> time registered
    users: Counter = field(default_factory=Counter)  # adapter -> requests here using it
    progress: float = 0.0
    last: float = 0.0
    paused_until: float = 0.0
    version: int = 0  # of the replica's scheduled completion event (the simulation bumps it)
    loads: int = 0
    slots: int = 0  # adapter slots (0: the calibration's)
    max_loras: int = 0  # distinct adapters in one batch (0: no limit)
    batch_adapters: Counter = field(default_factory=Counter)  # adapter -> sequences of it in the batch
    slot_timeout_s: float = 30.0
    failed: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = self.slots or self.cal.adapter_slots

    @property
    def ongoing(self) -> int:
        return len(self.batch) + len(self.waiting)

    @property
    def accepts(self) -> bool:
        return self.state == "running" and self.ongoing < self.max_ongoing

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.resident) - len(self.loading)

    @property
    def loadable_slots(self) -> int:
        return self.free_slots + sum(1 for a in self.resident if not self.users[a])

    def holds(self, adapter: str | None) -> bool:
        return adapter is None or adapter in self.resident or adapter in self.loading

    # ---- time ----------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        t = self.last
        if t < self.paused_until:
            t = min(self.paused_until, now)
        if now > t and self.batch:
            self.progress += (now - t) * 1000.0 / self.cal.step(len(self.batch))
        self.last = max(self.last, now)

    def next_completion(self) -> float | None:
        """Time of the next completion if nothing changes (the caller has advanced to ``last``)."""
        if not self.batch:
            return None
        start = max(self.last, self.paused_until)
        return start + (self.batch[0][0] - self.progress) * self.cal.step(len(self.batch)) / 1000.0

    # ---- requests ------------------------------------------------------------------------------
    def admit(self, req: Request, now: float, events) -> None:
        """A request routed here (``events(time, kind, payload)`` schedules what follows)."""
        self.advance(now)
        self.users[req.adapter] += 1
        req.admitted = now
        self.waiting.append(req)
        self._fill(now, events)

    def complete(self, now: float, events) -> list[Request]:
        """Requests whose last token is due by ``now``."""
        self.advance(now)
        done = []
        while self.batch and self.batch[0][0] <= self.progress + 1e-9:
            _, _, req = heapq.heappop(self.batch)
            req.done = now
            self.users[req.adapter] -= 1
            if req.adapter is not None:
                self.batch_adapters[req.adapter] -= 1
                if not self.batch_adapters[req.adapter]:
                    del self.batch_adapters[req.adapter]
            done.append(req)
        self._fill(now, events)
        return done

    def loaded(self, adapter: str, now: float, events) -> None:
        self.advance(now)
        self.loading.pop(adapter, None)
        self.resident[adapter] = None
        self._fill(now, events)

    def _fill(self, now: float, events) -> None:
        cap = self.cal.batch_capacity
        skipped: deque = deque()
        while self.waiting and len(self.batch) < cap:
            req = self.waiting.popleft()
            a = req.adapter
            if a is not None and a not in self.batch_adapters and 0 < self.max_loras <= len(self.batch_adapters):
                skipped.append(req)  # the batch already holds max_loras other adapters
                continue
            if a is None or a in self.resident:
                if a is not None:
                    self.resident.move_to_end(a)
                    self.batch_adapters[a] += 1
                b = len(self.batch) + 1
                delay = (self.cal.first_token_ms + self.cal.step(b) - self.cal.step(1)) / 1000.0
                req.first_token = max(now, self.paused_until) + delay
                req.finish_at = self.progress + req.output_tokens
                heapq.heappush(self.batch, (req.finish_at, next(_order), req))
                continue
            if a not in self.loading:
                self._start_load(a, now, events)  # False: no slot to load into, it waits for one
            if a in self.loading:
                req.loads = 1
            elif now - req.admitted >= self.slot_timeout_s:
                req.failed, req.done = True, now
                self.users[a] -= 1
                self.failed.append(req)
                continue
            skipped.append(req)
        skipped.extend(self.waiting)
        self.waiting = skipped

    def _start_load(self, adapter: str, now: float, events) -> bool:
        if self.free_slots <= 0:
            victim = next((a for a in self.resident if not self.users[a]), None)
            if victim is None:
                return False
            del self.resident[victim]
        self.loading[adapter] = now + self.cal.adapter_load_ms / 1000.0
        self.loads += 1
        self.paused_until = max(self.paused_until, now) + self.cal.adapter_stall_ms / 1000.0
        events(self.loading[adapter], "loaded", (self, adapter))
        return True
