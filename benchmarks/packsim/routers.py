"""The routing policies compared: loraplex's router, Ray Serve's default multiplexing router, and
one replica per tenant.

- ``LoraplexRouter`` ranks with the product's own ``app.routing.placement.rank_replicas``, from
  what the real router sees, built as it builds it (``placement.view_from_stats``): the last
  stats report (every ``stats_period_s``, as ``request_routing_stats_period_s``) and the
  adapters it sent each replica in the last ``recent_s``, queue lengths current; within a rank
  the shortest queue, as Serve does.
- ``ServeDefaultRouter`` follows Ray Serve 2.60's ``PowerOfTwoChoicesRequestRouter`` with
  ``MultiplexMixin``: two random replicas among those holding the model, the shorter queue that
  accepts; once that failed, the replicas holding the fewest models; after the matching timeout
  (uniform in [1, 2] s) the fewest-models replicas once more, then any replica.
- ``OnePerTenantRouter``: each tenant's requests go to its own replica.

``choose`` returns a replica that accepts the request, or None (it waits upstream and is tried
again when a replica frees up, or at ``retry_at``).
"""

from __future__ import annotations

import random

from app.routing.placement import rank_replicas, view_from_stats
from benchmarks.packsim.replica import Replica, Request

MATCHING_TIMEOUT_S = 1.0


class LoraplexRouter:
    name = "loraplex"

    def __init__(self, stats_period_s: float = 1.0, recent_s: float = 5.0) -> None:
        self.stats_period_s = stats_period_s
        self.recent_s = recent_s
        self._stats: dict[str, dict] = {}
        self._stats_at = -1e9
        self._recent: dict[str, dict[str, float]] = {}  # replica -> adapter -> when sent

    def _refresh(self, replicas: list[Replica], now: float) -> None:
        if now - self._stats_at >= self.stats_period_s:  # what EngineServer.record_routing_stats reports
            self._stats = {r.rid: {"resident": list(r.resident), "free_slots": r.free_slots,
                                   "loadable_slots": r.loadable_slots, "batch_capacity": r.cal.batch_capacity,
                                   "started_at": r.started_at, "active": [a for a, n in r.users.items() if n and a],
                                   "max_loras": r.max_loras or None} for r in replicas}
            self._stats_at = now

    def _recently_sent(self, rid: str, now: float) -> frozenset[str]:
        sent = self._recent.get(rid, {})
        for a in [a for a, t in sent.items() if now - t >= self.recent_s]:
            del sent[a]
        return frozenset(sent)

    def choose(self, req: Request, replicas: list[Replica], now: float) -> Replica | None:
        live = [r for r in replicas if r.state == "running"]
        self._refresh(live, now)
        views = [view_from_stats(r.rid, self._stats.get(r.rid, {"free_slots": r.slots, "started_at": r.started_at}),
                                 r.ongoing, r.max_ongoing, self._recently_sent(r.rid, now)) for r in live]
        by_id = {r.rid: r for r in live}
        for rank in rank_replicas(req.adapter, views):
            open_ = [by_id[i] for i in rank if by_id[i].accepts]
            if open_:
                chosen = min(open_, key=lambda r: r.ongoing)
                if req.adapter:
                    self._recent.setdefault(chosen.rid, {})[req.adapter] = now
                return chosen
        return None

    def retry_at(self, req: Request, now: float) -> float | None:
        return None


class ServeDefaultRouter:
    name = "serve-default"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self._state: dict[int, dict] = {}

    def _fewest(self, live: list[Replica]) -> list[Replica]:
        n = min(len(r.resident) + len(r.loading) for r in live)
        return [r for r in live if len(r.resident) + len(r.loading) == n]

    def choose(self, req: Request, replicas: list[Replica], now: float) -> Replica | None:
        live = [r for r in replicas if r.state == "running"]
        if not live:
            return None
        st = self._state.setdefault(id(req), {"start": now, "timeout": self.rng.uniform(MATCHING_TIMEOUT_S, 2 * MATCHING_TIMEOUT_S),
                                              "tried_first": False, "tried_fewest": False})
        if req.adapter is None:
            candidates = live
        elif now - st["start"] < st["timeout"]:
            holders = [r for r in live if r.holds(req.adapter)]
            candidates = holders if holders and not st["tried_first"] else self._fewest(live)
            st["tried_first"] = True
        elif not st["tried_fewest"]:
            candidates, st["tried_fewest"] = self._fewest(live), True
        else:
            candidates = live
        pair = self.rng.sample(candidates, min(2, len(candidates)))
        open_ = [r for r in pair if r.accepts]
        if not open_:
            return None
        self._state.pop(id(req), None)
        return min(open_, key=lambda r: r.ongoing)

    def retry_at(self, req: Request, now: float) -> float | None:
        st = self._state.get(id(req))
        return None if st is None else max(now + 0.05, st["start"] + st["timeout"])


class OnePerTenantRouter:
    name = "one-per-tenant"

    def choose(self, req: Request, replicas: list[Replica], now: float) -> Replica | None:
        own = next((r for r in replicas if r.rid == req.tenant), None)
        return own if own is not None and own.accepts else None

    def retry_at(self, req: Request, now: float) -> float | None:
        return None
