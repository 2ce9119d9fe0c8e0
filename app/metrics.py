"""Prometheus metrics of the serving path (per tenant and adapter), exposed at ``GET /metrics``."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "loraplex_requests_total", "Requests answered by the gateway", ["tenant", "adapter", "kind", "status"], registry=REGISTRY
)
LATENCY = Histogram(
    "loraplex_request_seconds",
    "Gateway time to the response head (full body for non-streaming)",
    ["tenant", "adapter", "kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)


def observe_request(tenant: str, adapter: str, kind: str, status: int, seconds: float) -> None:
    REQUESTS.labels(tenant, adapter, kind, str(status)).inc()
    LATENCY.labels(tenant, adapter, kind).observe(seconds)


def render() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
