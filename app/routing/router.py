"""Adapter-affinity request router for the engine deployment (a Ray Serve custom RequestRouter).

The gateway sets the request's ``multiplexed_model_id`` to the adapter id; engine replicas report
their residency through ``record_routing_stats`` (``resident``, ``free_slots``, ``engine_alive``). Ranking is
``app.routing.placement.rank_replicas``. Serve's default multiplexing router waits up to a second for a
replica that holds a cold model; this one never waits: a request goes where loading is cheapest.

Between stats reports (period ``request_routing_stats_period_s``) the router remembers where it
recently sent each adapter and treats those replicas as holders, so bursts for a cold adapter
stick to the replica that is loading it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from app.routing.placement import ReplicaView, rank_replicas

RECENT_S = 5.0
logger = logging.getLogger(__name__)


class AdapterAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, recent_s: float = RECENT_S, **kwargs: Any) -> None:
        self._recent_s = recent_s
        self._recent: dict[str, dict[ReplicaID, float]] = {}

    def _view(self, r: RunningReplica, adapter_id: str | None) -> ReplicaView:
        stats = r.routing_stats or {}
        resident = set(stats.get("resident") or ())
        now = time.monotonic()
        if adapter_id and now - self._recent.get(adapter_id, {}).get(r.replica_id, -1e9) < self._recent_s:
            resident.add(adapter_id)
        ongoing = self._replica_queue_len_cache.get(r.replica_id) or 0
        return ReplicaView(
            replica_id=r.replica_id.unique_id,
            resident=frozenset(resident),
            free_slots=int(stats.get("free_slots", 1)),
            ongoing=ongoing,
            max_ongoing=r.max_ongoing_requests,
            alive=bool(stats.get("engine_alive", True)),
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter_id = pending_request.metadata.multiplexed_model_id if pending_request else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r, adapter_id) for r in candidate_replicas]
        return [[by_id[i] for i in rank] for rank in rank_replicas(adapter_id or None, views)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter_id = pending_request.metadata.multiplexed_model_id
        logger.debug("request %s (adapter %r) routed to %s", pending_request.metadata.request_id,
                     adapter_id, replica_id.unique_id)
        if adapter_id:
            self._recent.setdefault(adapter_id, {})[replica_id] = time.monotonic()
