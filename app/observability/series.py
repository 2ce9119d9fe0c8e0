"""Every loraplex series: name, help, kind, tags and buckets, in one table.

Names follow Prometheus conventions (base units, ``_seconds``/``_bytes``; counters get
``_total`` on export). Ray's metrics agent exports each as ``ray_<name>``: ``exported`` is the
name a scrape shows. Tags ``tenant`` and ``adapter`` are capped (``app.observability.labels``);
``replica`` is the engine replica's id (one replica per process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "histogram", "gauge"]
RAY_PREFIX = "ray_"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class Series:
    """One series; ``buckets`` only for histograms (upper bounds, seconds)."""

    name: str
    help: str
    kind: Kind
    tags: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name in a scrape of Ray's metrics export (histograms add _bucket/_sum/_count)."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


# ---- gateway: per tenant and adapter -------------------------------------------------------------
REQUESTS = Series(
    "loraplex_requests", "Requests the gateway answered, by outcome: the HTTP status, or for a stream that "
    "failed after it started the error's status, 499 when the client left first.",
    "counter", ("tenant", "adapter", "kind", "status"))
REQUEST_DURATION = Series(
    "loraplex_request_duration_seconds", "Gateway time from a request's arrival to its last byte.",
    "histogram", ("tenant", "adapter", "kind"), DURATION_BUCKETS)
GATEWAY_QUEUE = Series(
    "loraplex_gateway_queue_seconds", "Gateway time from a request's arrival to its dispatch to an engine "
    "replica (authentication, adapter resolution, admission).",
    "histogram", ("tenant", "adapter"), QUEUE_BUCKETS)
ADMISSION_REJECTIONS = Series(
    "loraplex_admission_rejections", "Requests the gateway's admission refused (429/503), by reason.",
    "counter", ("tenant", "reason"))

# ---- engine replica: per tenant, adapter and replica ---------------------------------------------
TIME_TO_FIRST_TOKEN = Series(
    "loraplex_time_to_first_token_seconds", "Engine replica time from a request's arrival there (adapter "
    "residency included) to its first generated token.",
    "histogram", ("tenant", "adapter", "replica"), LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Series(
    "loraplex_inter_token_latency_seconds", "Time between consecutive generated tokens of a request, from "
    "vLLM's engine timestamps (outputs carrying several tokens count each at their mean interval).",
    "histogram", ("tenant", "adapter", "replica"), ITL_BUCKETS)
PROMPT_TOKENS = Series(
    "loraplex_prompt_tokens", "Prompt tokens of the requests an engine replica served.",
    "counter", ("tenant", "adapter", "replica"))
GENERATION_TOKENS = Series(
    "loraplex_generation_tokens", "Tokens an engine replica generated (completion tokens of the usage).",
    "counter", ("tenant", "adapter", "replica"))
ENGINE_REQUESTS = Series(
    "loraplex_engine_requests", "Requests an engine replica finished, by status.",
    "counter", ("tenant", "adapter", "replica", "status"))

# ---- engine replica: adapter residency (registry events) ------------------------------------------
ADAPTER_LOOKUPS = Series(
    "loraplex_adapter_lookups", "Adapter lookups per tier (disk cache, engine slots) and result (hit, miss).",
    "counter", ("tier", "result", "replica"))
ADAPTER_LOAD = Series(
    "loraplex_adapter_load_seconds", "Time to make an adapter available at a tier on a miss (disk: download "
    "and verify; engine: from the miss to add_lora returning, disk included).",
    "histogram", ("tier", "replica"), LOAD_BUCKETS)
ADAPTER_EVICTIONS = Series(
    "loraplex_adapter_evictions", "Adapters evicted or retired per tier.", "counter", ("tier", "replica"))
ADAPTER_LOAD_FAILURES = Series(
    "loraplex_adapter_load_failures", "Failed adapter loads per tier and error type.",
    "counter", ("tier", "error", "replica"))
ADAPTER_CACHE_BYTES = Series(
    "loraplex_adapter_cache_bytes", "Bytes held in the replica's adapter disk cache.", "gauge", ("replica",))
ADAPTER_SLOT_CAPACITY = Series(
    "loraplex_adapter_slot_capacity", "Adapters the replica's engine can hold registered at once (max_cpu_loras).",
    "gauge", ("replica",))
ADAPTERS_RESIDENT = Series(
    "loraplex_adapters_resident", "Versions of an adapter registered with the replica's engine now "
    "(0 after eviction).", "gauge", ("replica", "adapter"))

ALL = (
    REQUESTS, REQUEST_DURATION, GATEWAY_QUEUE, ADMISSION_REJECTIONS,
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, PROMPT_TOKENS, GENERATION_TOKENS, ENGINE_REQUESTS,
    ADAPTER_LOOKUPS, ADAPTER_LOAD, ADAPTER_EVICTIONS, ADAPTER_LOAD_FAILURES, ADAPTER_CACHE_BYTES,
    ADAPTER_SLOT_CAPACITY, ADAPTERS_RESIDENT,
)
