"""Where a loraplex cold start goes, from the stack's own metrics: ``loraplex_adapter_load_seconds``
per tier (disk: download and verify; engine: from the miss to ``add_lora`` returning, the disk
load included), read from every node's metrics export through the operator API, before and after
the cold request, the former once earlier loads have reached the export (``tests.helpers.metrics_scrape``:
what a Prometheus scrape would read)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from adapters_registry.events import Tier
from tests.helpers.metrics_scrape import Scrape, scrape, scrape_until

LOAD = "ray_loraplex_adapter_load_seconds"
EXPORT_S = 11.0  # longer than Ray's interval (10 s) between a process's reports to its node's export
TIERS: tuple[Tier, ...] = ("disk", "engine")


@dataclass
class OperatorAccess:
    """What ``tests.helpers.metrics_scrape`` needs of a stack: its URL and an operator's key."""

    base_url: str
    operator_key: str

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.operator_key}"}


def load_totals(s: Scrape) -> dict[str, tuple[float, float]]:
    """``tier -> (seconds, loads)`` summed over replicas and nodes."""
    return {t: (s.total(f"{LOAD}_sum", tier=t), s.total(f"{LOAD}_count", tier=t)) for t in TIERS}


def settled_totals(stack: OperatorAccess, export_s: float = EXPORT_S, timeout_s: float = 60.0) -> dict[str, tuple[float, float]]:
    """The totals once two scrapes ``export_s`` apart agree: loads recorded just before (a
    previous phase's) have reached the export, so they do not count as the next one's."""
    last = load_totals(scrape(stack))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(export_s)
        now = load_totals(scrape(stack))
        if now == last:
            return now
        last = now
    return last


def load_split(stack: OperatorAccess, before: dict[str, tuple[float, float]],
               timeout_s: float = 45.0) -> dict[str, float | None]:
    """Seconds of the one load per tier since ``before`` (None where the count did not move by
    exactly one within ``timeout_s``: Ray's agent exports what replicas recorded every few seconds)."""
    def moved(s: Scrape) -> bool:
        now = load_totals(s)
        return all(now[t][1] > before[t][1] for t in TIERS)

    now = load_totals(scrape_until(stack, moved, timeout_s=timeout_s))
    return {t: now[t][0] - before[t][0] if now[t][1] - before[t][1] == 1 else None for t in TIERS}
