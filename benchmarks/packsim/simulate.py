"""The event loop: arrivals, routing, replicas, autoscaling; what one policy costs and delivers.

A policy is a router (``benchmarks.packsim.routers``) and how replicas are provisioned: Serve's
default autoscaler over a shared pool (``loraplex``, ``serve-default``), loraplex's demand
autoscaler (``app.routing.autoscaling.DemandPlanner``) with loraplex's router (``loraplex-demand``),
or one replica per tenant, always on. Requests no replica accepts wait upstream, first come first served, and are tried again
whenever a replica frees up. Scaling down stops replicas still starting first, then the newest
running ones (Serve's choice), which finish their requests before they stop. Replicas are paid
for from start to stop. TTFT = arrival to first token + the calibration's HTTP path overhead.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from pydantic import BaseModel, Field

from app.routing.autoscaling import DemandPlanner, DemandSpec
from benchmarks.loadgen.spec import Percentiles
from benchmarks.loadgen.stats import summarise
from benchmarks.packsim.autoscaler import Autoscaler, AutoscaleSpec
from benchmarks.packsim.calibration import Calibration
from benchmarks.packsim.replica import Replica, Request
from benchmarks.packsim.routers import (
    LoraplexRouter,
    OnePerTenantRouter,
    ServeDefaultRouter,
)
from benchmarks.packsim.workload import WorkloadSpec, arrivals, tenant_name

POLICIES = ("loraplex-demand", "loraplex", "serve-default", "one-per-tenant")
SERIES_S = 60.0
RETRY_SCAN = 16  # pending requests tried per freed replica before giving up until the next event


class SeriesPoint(BaseModel):
    t: float
    replicas: int = Field(description="Replicas paid for (starting, running, draining).")
    load: float = Field(description="Σ tenant load at t, in replicas.")
    ttft_p99_ms: float | None = Field(None, description="p99 TTFT of the requests that arrived in the last minute.")


class PolicyResult(BaseModel):
    policy: str
    requests: int
    completed: int
    failed: int = Field(0, description="Requests that waited too long for an adapter slot (503).")
    ttft_ms: Percentiles | None
    ttft_max_ms: float | None
    over_1s: float = Field(description="Fraction of requests whose TTFT exceeded 1 s.")
    mean_replicas: float = Field(description="Replica-seconds / duration: replicas needed.")
    peak_replicas: int
    mean_load: float = Field(description="Mean Σ load, in replicas: the ideal.")
    floor_replicas: float = Field(description="Time mean of ⌈Σ load⌉ (at least min_replicas): the whole-replica floor.")
    peak_load: float
    adapter_loads: int
    series: list[SeriesPoint] = Field(default_factory=list)


class _Sim:
    def __init__(self, wl: WorkloadSpec, cal: Calibration, policy: str, autoscale: AutoscaleSpec,
                 max_ongoing_factor: float, adapter_slots: int, max_loras: int, demand: DemandSpec) -> None:
        self.wl, self.cal, self.policy, self.slots, self.max_loras = wl, cal, policy, adapter_slots, max_loras
        self.max_ongoing = max(1, int(cal.batch_capacity * max_ongoing_factor))
        self.events: list = []
        self.seq = itertools.count()
        self.replicas: list[Replica] = []
        self.pending: deque[Request] = deque()
        self.done: list[Request] = []
        self.replica_seconds = 0.0
        self.peak = 0
        self.n_new = itertools.count()
        self.router = {"loraplex-demand": LoraplexRouter, "loraplex": LoraplexRouter,
                       "serve-default": ServeDefaultRouter, "one-per-tenant": OnePerTenantRouter}[policy]()
        self.autoscaler = None if policy == "one-per-tenant" else Autoscaler(autoscale, cal.batch_capacity)
        self.decide = self.autoscaler.decide if self.autoscaler else None  # (now, total, current) -> replicas
        if policy == "loraplex-demand":  # the product's policy, per replica Serve's target
            planner, per = DemandPlanner(demand), self.autoscaler.target_ongoing
            self.decide = lambda now, total, current: planner.decide(now, total, current, per, autoscale.min_replicas,
                                                                     autoscale.max_replicas)
        self.target = 0
        self.n_paid = 0

    def push(self, t: float | None, kind: str, payload) -> None:
        if t is not None:
            heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def resched(self, r: Replica) -> None:
        r.version += 1
        self.push(r.next_completion(), "complete", (r, r.version))

    def start_replica(self, now: float, rid: str | None = None, ready: bool = False) -> None:
        r = Replica(rid or f"r{next(self.n_new)}", self.cal, self.max_ongoing, started_at=now,
                    ready_at=now if ready else now + self.cal.replica_start_s, last=now,
                    slots=1 if self.policy == "one-per-tenant" else self.slots, max_loras=self.max_loras)
        self.replicas.append(r)
        self.n_paid += 1
        if ready:
            r.state = "running"
        else:
            self.push(r.ready_at, "ready", r)

    def scale_to(self, target: int, now: float) -> None:
        active = [r for r in self.replicas if r.state in ("starting", "running")]
        for _ in range(target - len(active)):
            self.start_replica(now)
        surplus = len(active) - target
        for r in sorted(active, key=lambda r: (r.state != "starting", -r.started_at))[:max(0, surplus)]:
            r.state = "draining"
            if not r.ongoing:
                self.stop(r, now)
        self.target = target

    def stop(self, r: Replica, now: float) -> None:
        r.state, r.stopped_at = "stopped", now
        self.n_paid -= 1

    def dispatch(self, req: Request, now: float) -> bool:
        r = self.router.choose(req, self.replicas, now)
        if r is None:
            return False
        r.admit(req, now, self.push)
        self.resched(r)
        return True

    def drain_pending(self, now: float) -> None:
        misses = 0
        kept: deque[Request] = deque()
        while self.pending and misses < RETRY_SCAN:
            req = self.pending.popleft()
            if self.dispatch(req, now):
                misses = 0
            else:
                kept.append(req)
                misses += 1
        kept.extend(self.pending)
        self.pending = kept

    def run(self) -> PolicyResult:
        wl, cal = self.wl, self.cal
        if self.policy == "one-per-tenant":
            for i in range(wl.tenants):
                self.start_replica(0.0, tenant_name(i), ready=True)
        else:
            first = max(self.autoscaler.spec.min_replicas, math.ceil(wl.total_load(0.0)))
            for _ in range(first):
                self.start_replica(0.0, ready=True)
            self.target = first
            self.push(0.0, "tick", None)
        stream = arrivals(wl, cal.capacity_tokens_per_s)
        nxt = next(stream, None)
        if nxt:
            self.push(nxt[0], "arrival", nxt[1])
        self.push(SERIES_S, "series", None)
        series: list[SeriesPoint] = []
        window: list[Request] = []
        last_t, n_req = 0.0, 0
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > wl.duration_s and kind in ("tick", "series"):
                continue
            self.replica_seconds += self.n_paid * (t - last_t)
            last_t = t
            if kind == "arrival":
                n_req += 1
                req = Request(payload, payload, t, wl.output_tokens)
                window.append(req)
                if not self.dispatch(req, t):
                    self.pending.append(req)
                    self.push(self.router.retry_at(req, t), "retry", req)
                nxt = next(stream, None)
                if nxt:
                    self.push(nxt[0], "arrival", nxt[1])
            elif kind == "retry":
                if payload in self.pending:
                    self.pending.remove(payload)
                    if not self.dispatch(payload, t):
                        self.pending.append(payload)
                        self.push(self.router.retry_at(payload, t), "retry", payload)
            elif kind == "complete":
                r, version = payload
                if version != r.version:
                    continue
                self.done.extend(r.complete(t, self.push))
                self.resched(r)
                if r.state == "draining" and not r.ongoing:
                    self.stop(r, t)
                self.drain_pending(t)
            elif kind == "loaded":
                r, adapter = payload
                r.loaded(adapter, t, self.push)
                self.resched(r)
                self.drain_pending(t)
            elif kind == "ready":
                if payload.state == "starting":
                    payload.state = "running"
                    self.drain_pending(t)
            elif kind == "tick":
                total = sum(r.ongoing for r in self.replicas if r.state != "stopped") + len(self.pending)
                target = self.decide(t, total, self.target)
                if target != self.target:
                    self.scale_to(target, t)
                self.push(t + self.autoscaler.spec.control_period_s, "tick", None)
            elif kind == "series":
                ttfts = [(r.first_token - r.arrival) * 1000 for r in window if r.first_token is not None]
                series.append(SeriesPoint(t=t, replicas=self.n_paid, load=wl.total_load(t),
                                          ttft_p99_ms=summarise(ttfts).p99 if ttfts else None))
                window = [r for r in window if r.first_token is None]
                self.push(t + SERIES_S, "series", None)
            self.peak = max(self.peak, self.n_paid)
        overhead = cal.path_overhead_ms
        ttfts = [(r.first_token - r.arrival) * 1000 + overhead for r in self.done if r.first_token is not None]
        return PolicyResult(
            policy=self.policy, requests=n_req, completed=len(self.done),
            failed=sum(len(r.failed) for r in self.replicas), ttft_ms=summarise(ttfts),
            ttft_max_ms=max(ttfts, default=None), over_1s=sum(x > 1000 for x in ttfts) / max(1, len(ttfts)),
            mean_replicas=self.replica_seconds / max(last_t, 1e-9), peak_replicas=self.peak,
            mean_load=wl.mean_total_load(),
            floor_replicas=wl.mean_whole_replicas(self.autoscaler.spec.min_replicas if self.autoscaler else 1),
            peak_load=max(wl.total_load(wl.period_s / 2), wl.total_load(0)),
            adapter_loads=sum(r.loads for r in self.replicas), series=series)


def simulate(wl: WorkloadSpec, cal: Calibration, policy: str, autoscale: AutoscaleSpec | None = None,
             max_ongoing_factor: float = 2.0, adapter_slots: int = 0, max_loras: int = 0,
             demand: DemandSpec | None = None) -> PolicyResult:
    """One policy on one workload (``adapter_slots`` per replica, 0: the calibration's;
    ``max_loras`` distinct adapters per batch, 0: no limit; ``demand``: the demand autoscaler's
    settings, None: its defaults with ``lead_s`` the calibration's replica start)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    demand = demand or DemandSpec(lead_s=cal.replica_start_s)
    return _Sim(wl, cal, policy, autoscale or AutoscaleSpec(), max_ongoing_factor, adapter_slots, max_loras,
                demand).run()
