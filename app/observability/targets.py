"""The cluster's scrape targets: every live node's Ray metrics export address.

Answered in Prometheus's HTTP service-discovery format, so a Prometheus outside Kubernetes can
discover the nodes through the gateway's operator API (``GET /admin/metrics/targets``); inside
Kubernetes the chart's ServiceMonitor reaches the same ports through the metrics Service.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field


class TargetGroup(BaseModel):
    """One entry of Prometheus's HTTP service discovery (``http_sd_configs``)."""

    targets: list[str] = Field(description="host:port of a node's Ray metrics export (scrape path /metrics).")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels Prometheus attaches to the target.")


def _nodes() -> list[dict]:
    import ray

    return ray.nodes()


async def scrape_targets() -> list[TargetGroup]:
    """One group per live node (``ray.nodes()``, a blocking GCS call, runs in a thread)."""
    groups = []
    for node in await asyncio.to_thread(_nodes):
        if node.get("Alive") and node.get("MetricsExportPort"):
            groups.append(TargetGroup(
                targets=[f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"],
                labels={"ray_node_id": node["NodeID"]},
            ))
    return groups
