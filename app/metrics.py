"""Metrics of the serving path, per tenant and adapter.

Recorded twice: in this process's Prometheus registry (``GET /metrics`` of the gateway replica
that answers) and through Ray's metrics agent (``ray.util.metrics``), which Ray exports from every
node, so a cluster-wide scrape (the chart's ServiceMonitor) sees all gateway replicas. Outside a
Ray worker the Ray side is skipped.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

logger = logging.getLogger(__name__)
LABELS = ("tenant", "adapter", "kind", "status")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REGISTRY = CollectorRegistry()
REQUESTS = Counter("loraplex_requests_total", "Requests answered by the gateway", LABELS, registry=REGISTRY)
LATENCY = Histogram(
    "loraplex_request_seconds", "Gateway time to the response head (full body for non-streaming)",
    LABELS[:3], buckets=BUCKETS, registry=REGISTRY,
)
_ray_metrics: tuple | None = None


def _ray():
    """``(counter, histogram)`` of ray.util.metrics, created on first use inside a Ray worker."""
    global _ray_metrics
    if _ray_metrics is None:
        try:
            import ray
            from ray.util import metrics as rm

            if not ray.is_initialized():
                return None
            _ray_metrics = (
                rm.Counter("loraplex_requests", "Requests answered by the gateway", tag_keys=LABELS),
                rm.Histogram("loraplex_request_seconds", "Gateway time to the response head",
                             boundaries=list(BUCKETS), tag_keys=LABELS[:3]),
            )
        except Exception as exc:  # metrics must never fail a request
            logger.warning("Ray metrics unavailable: %s", exc)
            _ray_metrics = ()
    return _ray_metrics or None


def observe_request(tenant: str, adapter: str, kind: str, status: int, seconds: float) -> None:
    REQUESTS.labels(tenant, adapter, kind, str(status)).inc()
    LATENCY.labels(tenant, adapter, kind).observe(seconds)
    ray_side = _ray()
    if ray_side:
        counter, hist = ray_side
        counter.inc(tags={"tenant": tenant, "adapter": adapter, "kind": kind, "status": str(status)})
        hist.observe(seconds, tags={"tenant": tenant, "adapter": adapter, "kind": kind})


def render() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
