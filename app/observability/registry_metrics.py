"""The registry's events of one engine replica as metrics (``adapters_registry.events``).

Lookups, loads, evictions and failures per tier; the disk cache's bytes; the slot table's
capacity and, per adapter, how many of its versions are registered with the engine. Adapters
that leave the engine are set to 0, so a scrape shows the current residency per replica.
``refresh()`` records the gauges' last values again (the replica calls it with every health
check): a value recorded once, while the replica was starting, may not reach Ray's agent.
"""

from __future__ import annotations

from collections import Counter

from adapters_registry.events import RegistryObserver, Tier
from app.observability import series
from app.observability.instruments import instrument
from app.observability.labels import Labels


class ReplicaRegistryMetrics(RegistryObserver):
    """Records one replica's registry events, tagged with its replica id."""

    def __init__(self, labels: Labels, replica: str) -> None:
        self.labels = labels
        self.replica = replica
        self.lookups = instrument(series.ADAPTER_LOOKUPS)
        self.load = instrument(series.ADAPTER_LOAD)
        self.evictions = instrument(series.ADAPTER_EVICTIONS)
        self.failures = instrument(series.ADAPTER_LOAD_FAILURES)
        self.cache = instrument(series.ADAPTER_CACHE_BYTES)
        self.capacity = instrument(series.ADAPTER_SLOT_CAPACITY)
        self.resident = instrument(series.ADAPTERS_RESIDENT)
        self._shown: dict[str, int] = {}  # adapter label -> resident versions last exported (> 0)
        self._capacity: int | None = None
        self._cache_bytes: int | None = None

    def lookup(self, tier: Tier, hit: bool) -> None:
        self.lookups.record(1, {"tier": tier, "result": "hit" if hit else "miss", "replica": self.replica})

    def loaded(self, tier: Tier, seconds: float) -> None:
        self.load.record(seconds, {"tier": tier, "replica": self.replica})

    def evicted(self, tier: Tier) -> None:
        self.evictions.record(1, {"tier": tier, "replica": self.replica})

    def failed(self, tier: Tier, error: str) -> None:
        self.failures.record(1, {"tier": tier, "error": error, "replica": self.replica})

    def cache_bytes(self, used: int) -> None:
        self._cache_bytes = used
        self.cache.record(used, {"replica": self.replica})

    def residency(self, adapter_ids: list[str], capacity: int) -> None:
        self._capacity = capacity
        self.capacity.record(capacity, {"replica": self.replica})
        counts = Counter(self.labels.adapter(a) for a in adapter_ids)
        for label in set(self._shown) - set(counts):
            self.resident.record(0, {"replica": self.replica, "adapter": label})
        for label, n in counts.items():
            self.resident.record(n, {"replica": self.replica, "adapter": label})
        self._shown = dict(counts)

    def refresh(self) -> None:
        """Records every gauge's last value again."""
        if self._capacity is not None:
            self.capacity.record(self._capacity, {"replica": self.replica})
        if self._cache_bytes is not None:
            self.cache.record(self._cache_bytes, {"replica": self.replica})
        for label, n in self._shown.items():
            self.resident.record(n, {"replica": self.replica, "adapter": label})
