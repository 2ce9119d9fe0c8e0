"""The registry's events for whoever exports them (the engine replica records them as metrics).

Tiers: ``disk`` (local cache ← store) and ``engine`` (slot table ← disk). The cache and the slot
table call their ``observer`` synchronously on the event loop; an observer must not block and
must not raise. ``RegistryObserver`` ignores every event: subclass it and override what you
record. The registry itself keeps no metrics and imports no metrics library.
"""

from __future__ import annotations

from typing import Literal

Tier = Literal["disk", "engine"]


class RegistryObserver:
    """Receives the registry's events; every method is a no-op here."""

    def lookup(self, tier: Tier, hit: bool) -> None:
        """An adapter was looked up at ``tier``: present (hit) or to be loaded (miss)."""

    def loaded(self, tier: Tier, seconds: float) -> None:
        """A miss finished loading at ``tier`` after ``seconds`` (disk: download + verify;
        engine: everything from the miss to ``add_lora`` returning, disk load included)."""

    def evicted(self, tier: Tier) -> None:
        """An adapter left ``tier`` to make room or because it was retired."""

    def failed(self, tier: Tier, error: str) -> None:
        """A load at ``tier`` failed with the exception type named ``error``."""

    def cache_bytes(self, used: int) -> None:
        """The disk cache now holds ``used`` bytes."""

    def residency(self, adapter_ids: list[str], capacity: int) -> None:
        """The adapters loaded in the engine now (one id per loaded version) and the table's capacity."""


NO_OBSERVER = RegistryObserver()
