"""Adapter placement policy: which engine replicas a request for an adapter should try, in order.

Pure and Ray-free (the Serve router in ``app.routing.router`` feeds it). Ranks, most preferred first:

1. **Holders**: replicas with the adapter resident and headroom, least loaded first. When every
   holder is at least ``hot_load_fraction`` busy, the adapter is hot: replicas with a free slot
   join this rank so it spreads over several replicas instead of queueing.
2. **Best fit**: replicas with a free slot, the busiest first — packing cold adapters onto
   replicas that are already working leaves idle replicas idle, so autoscaling can remove them.
3. **Evict**: any other replica with headroom, least loaded first (loading there evicts its
   least recently used unpinned adapter).
4. Full replicas last (Serve then backs off and retries).

Replicas whose engine died are left out while any other replica is alive (Serve's health checks
replace them); when none is alive, they are ranked as usual and answer 503.

Load = ongoing requests / max_ongoing_requests (unknown queue length counts as idle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOT_LOAD_FRACTION = 0.5
PER_RANK = 2


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: str
    resident: frozenset[str] = field(default_factory=frozenset)
    free_slots: int = 0
    ongoing: int = 0
    max_ongoing: int = 1
    alive: bool = True

    @property
    def load(self) -> float:
        return self.ongoing / max(1, self.max_ongoing)

    @property
    def has_headroom(self) -> bool:
        return self.ongoing < self.max_ongoing


def rank_replicas(
    adapter_id: str | None,
    replicas: list[ReplicaView],
    hot_load_fraction: float = HOT_LOAD_FRACTION,
    per_rank: int = PER_RANK,
) -> list[list[str]]:
    """Replica ids in preference ranks (each at most ``per_rank`` long); see the module doc."""
    if not replicas:
        return []
    replicas = [r for r in replicas if r.alive] or replicas
    open_ = [r for r in replicas if r.has_headroom]
    full = sorted((r for r in replicas if not r.has_headroom), key=lambda r: r.load)
    if not adapter_id:  # base model: least loaded first
        by_load = sorted(open_, key=lambda r: r.load)
        return _chunks([r.replica_id for r in by_load + full], per_rank)

    holders = sorted((r for r in open_ if adapter_id in r.resident), key=lambda r: r.load)
    others = [r for r in open_ if adapter_id not in r.resident]
    with_slot = sorted((r for r in others if r.free_slots > 0), key=lambda r: -r.load)
    evict = sorted((r for r in others if r.free_slots <= 0), key=lambda r: r.load)
    all_holders = [r for r in replicas if adapter_id in r.resident]
    hot = bool(all_holders) and all(r.load >= hot_load_fraction for r in all_holders)

    ranks: list[list[str]] = []
    first = [r.replica_id for r in holders[:per_rank]]
    if hot or not first:
        spill = sorted(with_slot, key=lambda r: r.load) if hot else with_slot
        first += [r.replica_id for r in spill[: max(0, per_rank - len(first))] if r.replica_id not in first]
    if first:
        ranks.append(first)
    seen = set(first)
    rest = [r.replica_id for r in holders + with_slot + evict + full if r.replica_id not in seen]
    return ranks + _chunks(rest, per_rank)


def _chunks(ids: list[str], n: int) -> list[list[str]]:
    return [ids[i : i + n] for i in range(0, len(ids), n)]
