"""Prometheus metrics of the registry (process-global, like every prometheus_client metric).

Tiers: ``disk`` (local cache ← store) and ``engine`` (slots table ← disk).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LOOKUPS = Counter(
    "loraplex_adapter_lookups_total", "Adapter lookups per tier and result (hit/miss).", ["tier", "result"]
)
LOAD_SECONDS = Histogram(
    "loraplex_adapter_load_seconds",
    "Seconds to make an adapter available at a tier on a miss (disk: download+verify; engine: add_lora).",
    ["tier"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
EVICTIONS = Counter("loraplex_adapter_evictions_total", "Adapters evicted per tier.", ["tier"])
FAILURES = Counter("loraplex_adapter_load_failures_total", "Failed adapter loads per tier and error.", ["tier", "error"])
CACHE_BYTES = Gauge("loraplex_adapter_cache_bytes", "Bytes held in the local adapter disk cache.")
RESIDENT = Gauge("loraplex_adapter_resident", "Adapters registered with this replica's engine.")
