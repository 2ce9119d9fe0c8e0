"""Adapter-affinity request router for the engine deployment (a Ray Serve custom RequestRouter).

The gateway sets the request's ``multiplexed_model_id`` to the adapter id; engine replicas report
their residency and shape through ``record_routing_stats`` (``resident``, ``free_slots``,
``loadable_slots``, ``batch_capacity``, ``started_at``, ``engine_alive``). Ranking is
``app.routing.placement.rank_replicas``. Serve's default multiplexing router waits up to a second for a
replica that holds a cold model; this one never waits: a request goes where loading is cheapest.

Between stats reports (period ``request_routing_stats_period_s``) the router remembers where it
recently sent each adapter and treats those replicas as holders, so bursts for a cold adapter
stick to the replica that is loading it, and counts the ones a report does not show yet as
taking a slot there (``placement.view_from_stats``).
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

from app.routing.placement import ReplicaView, rank_replicas, view_from_stats

RECENT_S = 5.0
logger = logging.getLogger(__name__)


class AdapterAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, recent_s: float = RECENT_S, **kwargs: Any) -> None:
        self._recent_s = recent_s
        self._recent: dict[ReplicaID, dict[str, float]] = {}  # replica -> adapter -> when sent

    def _recently_sent(self, replica_id: ReplicaID, now: float) -> frozenset[str]:
        sent = self._recent.get(replica_id, {})
        for adapter in [a for a, t in sent.items() if now - t >= self._recent_s]:
            del sent[adapter]
        return frozenset(sent)

    def _view(self, r: RunningReplica, now: float) -> ReplicaView:
        ongoing = self._replica_queue_len_cache.get(r.replica_id) or 0
        return view_from_stats(r.replica_id.unique_id, r.routing_stats or {}, ongoing, r.max_ongoing_requests,
                               self._recently_sent(r.replica_id, now))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter_id = pending_request.metadata.multiplexed_model_id if pending_request else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        views = [self._view(r, now) for r in candidate_replicas]
        return [[by_id[i] for i in rank] for rank in rank_replicas(adapter_id or None, views)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter_id = pending_request.metadata.multiplexed_model_id
        logger.debug("request %s (adapter %r) routed to %s", pending_request.metadata.request_id,
                     adapter_id, replica_id.unique_id)
        if adapter_id:
            self._recent.setdefault(replica_id, {})[adapter_id] = time.monotonic()
