"""Label values with bounded cardinality: tenant and adapter names as they come, up to a cap each.

The first ``max_tenant_labels`` tenants and ``max_adapter_labels`` adapters a process sees keep
their names; later ones are exported as ``other`` (so which names stay named is per process).
``-`` stands for "not known" (no valid key, no resolved adapter).
"""

from __future__ import annotations

from app.observability.config import ObservabilityConfig

OTHER = "other"
UNKNOWN = "-"


class LabelCap:
    """At most ``limit`` distinct values of one label; ``UNKNOWN`` never counts against it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._named or value == UNKNOWN:
            return value
        if len(self._named) < self.limit:
            self._named.add(value)
            return value
        return OTHER


class Labels:
    """The tenant and adapter caps of one process."""

    def __init__(self, cfg: ObservabilityConfig) -> None:
        self.tenant = LabelCap(cfg.max_tenant_labels)
        self.adapter = LabelCap(cfg.max_adapter_labels)
