"""Adapter placement policy: which engine replicas a request for an adapter should try, in order.

Pure and Ray-free (the Serve router in ``app.routing.router`` feeds it). Serve tries the ranks in
order and, within a rank, the replica with the shortest queue; so the ranks that pack hold one
replica each. Ranks, most preferred first:

1. **Holders with batch room**: replicas with the adapter resident and a free sequence slot in
   their batch (``ongoing < batch_capacity``) it may use (its adapter is already in use there,
   or fewer than ``max_loras`` adapters are: vLLM batches at most ``max_loras`` adapters and
   makes the others wait), oldest first.
2. **Best fit**: replicas with a free adapter slot and batch room, oldest first — a cold adapter
   joins work that is already packed instead of waking an idle replica; when every holder's
   batch is full this is also where a hot adapter spreads.
3. **Holders' queues**: holders whose batch is full but whose queue is not, least loaded first,
   two per rank — waiting there for a batch slot (one frees every service time ÷ batch size)
   beats evicting an adapter another request will load back.
4. **Evict**: replicas with batch room where loading evicts the least recently used adapter no
   request is using, oldest first (a replica whose adapters are all in use cannot load it now).
5. **Queue**: every other replica Serve would still accept, least loaded first, two per rank.
6. Full replicas last (Serve then backs off and retries).

The base model (no adapter) takes ranks 1 and 5 over all replicas. Oldest first packs work onto
the replicas Serve keeps when it scales down (it stops the newest first), so the replicas it
removes are the idle ones. Load = ongoing requests / max_ongoing_requests.

Replicas whose engine died are left out while any other replica is alive (Serve's health checks
replace them); when none is alive, they are ranked as usual and answer 503.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PER_RANK = 2


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: str
    resident: frozenset[str] = field(default_factory=frozenset)
    free_slots: int = 0
    ongoing: int = 0
    max_ongoing: int = 1
    batch_capacity: int | None = None  # sequences its engine batches at once (None: max_ongoing)
    started_at: float = 0.0  # when it started (older: packed first)
    loadable_slots: int | None = None  # free slots + idle evictable ones (None: unknown, assume some)
    active: frozenset[str] | None = None  # adapters requests use there now (None: unknown)
    max_loras: int | None = None  # adapters its engine batches at once (None: no limit known)
    alive: bool = True  # its engine answers (False: it died; Serve replaces it)

    @property
    def load(self) -> float:
        return self.ongoing / max(1, self.max_ongoing)

    @property
    def has_headroom(self) -> bool:
        return self.ongoing < self.max_ongoing

    @property
    def has_batch_room(self) -> bool:
        return self.ongoing < min(self.max_ongoing, self.batch_capacity or self.max_ongoing)


def _room_for(r: ReplicaView, adapter_id: str) -> bool:
    """Batch room a request for ``adapter_id`` may use (vLLM's ``max_loras`` limit)."""
    if not r.has_batch_room:
        return False
    if r.active is None or r.max_loras is None or adapter_id in r.active:
        return True
    return len(r.active) < r.max_loras


def _age(r: ReplicaView) -> tuple[float, str]:
    return (r.started_at, r.replica_id)


def rank_replicas(adapter_id: str | None, replicas: list[ReplicaView], per_rank: int = PER_RANK) -> list[list[str]]:
    """Replica ids in preference ranks; every replica appears exactly once (see the module doc)."""
    replicas = [r for r in replicas if r.alive] or replicas
    roomy = sorted((r for r in replicas if r.has_batch_room), key=_age)
    ranks: list[list[str]] = []
    if adapter_id:
        roomy = [r for r in roomy if _room_for(r, adapter_id)]
        holders = [r for r in roomy if adapter_id in r.resident]
        best_fit = [r for r in roomy if adapter_id not in r.resident and r.free_slots > 0]
        ranks += [[r.replica_id] for r in holders + best_fit]
        taken = {r.replica_id for r in holders + best_fit}
        queued = sorted((r for r in replicas if adapter_id in r.resident and r.has_headroom
                         and r.replica_id not in taken), key=lambda r: r.load)
        ranks += _chunks([r.replica_id for r in queued], per_rank)
        evict = [r for r in roomy if r.replica_id not in taken and adapter_id not in r.resident
                 and (r.loadable_slots is None or r.loadable_slots > 0)]
        ranks += [[r.replica_id] for r in evict]
    else:
        ranks += [[r.replica_id] for r in roomy]
    taken = {i for rank in ranks for i in rank}
    queue = sorted((r for r in replicas if r.has_headroom and r.replica_id not in taken), key=lambda r: r.load)
    full = sorted((r for r in replicas if not r.has_headroom and r.replica_id not in taken), key=lambda r: r.load)
    return ranks + _chunks([r.replica_id for r in queue + full], per_rank)


def view_from_stats(replica_id: str, stats: dict, ongoing: int, max_ongoing: int,
                    recently_sent: frozenset[str] = frozenset()) -> ReplicaView:
    """A replica's view from its last routing-stats report (``EngineServer.record_routing_stats``)
    and the adapters this router sent it since (``recently_sent``): those count as resident, and
    the ones the report does not show yet as taking a slot each (so a burst of cold adapters does
    not overfill a replica that reported free slots)."""
    reported = frozenset(stats.get("resident") or ())
    pending = len(recently_sent - reported)
    free = int(stats.get("free_slots", 1))
    loadable = stats.get("loadable_slots")
    active = stats.get("active")
    return ReplicaView(
        replica_id=replica_id, resident=reported | recently_sent, free_slots=free - pending, ongoing=ongoing,
        max_ongoing=max_ongoing, batch_capacity=stats.get("batch_capacity"),
        started_at=float(stats.get("started_at", 0.0)),
        loadable_slots=None if loadable is None else int(loadable) - pending,
        active=None if active is None else frozenset(active) | recently_sent, max_loras=stats.get("max_loras"),
        alive=bool(stats.get("engine_alive", True)))


def _chunks(ids: list[str], n: int) -> list[list[str]]:
    return [ids[i : i + n] for i in range(0, len(ids), n)]
