"""A registry observer that keeps every event it receives, in order (for the registry tests)."""

from __future__ import annotations

from adapters_registry.events import RegistryObserver, Tier


class EventLog(RegistryObserver):
    """``events``: ``(name, *arguments)`` tuples in the order the registry emitted them."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def lookup(self, tier: Tier, hit: bool) -> None:
        self.events.append(("lookup", tier, hit))

    def loaded(self, tier: Tier, seconds: float) -> None:
        self.events.append(("loaded", tier, seconds))

    def evicted(self, tier: Tier) -> None:
        self.events.append(("evicted", tier))

    def failed(self, tier: Tier, error: str) -> None:
        self.events.append(("failed", tier, error))

    def cache_bytes(self, used: int) -> None:
        self.events.append(("cache_bytes", used))

    def residency(self, adapter_ids: list[str], capacity: int) -> None:
        self.events.append(("residency", tuple(adapter_ids), capacity))

    def named(self, name: str, *args) -> list[tuple]:
        """Events called ``name`` whose first arguments equal ``args``."""
        return [e for e in self.events if e[0] == name and e[1:1 + len(args)] == args]
