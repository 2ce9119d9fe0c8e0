"""Scrapes of a running stack's metrics, parsed with prometheus_client's parser.

``scrape(stack)`` asks the operator API for the cluster's scrape targets (every node's Ray
metrics export) and reads each one's ``/metrics``: what the chart's ServiceMonitor collects.
``Scrape`` sums samples over the labels a query does not name (Ray adds WorkerId, NodeAddress,
SessionName, ...), as a Prometheus ``sum by (...)`` would.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

DASHBOARD_SERIES = re.compile(r"\bray_[A-Za-z0-9_]+")


@dataclass
class Scrape:
    samples: list[Sample]

    def names(self) -> set[str]:
        """Sample names (histograms as their _bucket, _sum and _count series)."""
        return {s.name for s in self.samples}

    def matching(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(s.value for s in self.matching(name, **labels))

    def by(self, name: str, keys: tuple[str, ...], **labels: str) -> dict[tuple[str, ...], float]:
        """``sum by (keys)`` of the samples of ``name`` whose labels include ``labels``."""
        out: dict[tuple[str, ...], float] = defaultdict(float)
        for s in self.matching(name, **labels):
            out[tuple(s.labels.get(k, "") for k in keys)] += s.value
        return dict(out)


def targets(stack) -> list[str]:
    """``host:port`` of every node's metrics export, from ``GET /admin/metrics/targets``."""
    r = httpx.get(stack.base_url + "/admin/metrics/targets", headers=stack.headers("operator"), timeout=30)
    r.raise_for_status()
    return [t for group in r.json() for t in group["targets"]]


def scrape(stack) -> Scrape:
    samples: list[Sample] = []
    for target in targets(stack):
        text = httpx.get(f"http://{target}/metrics", timeout=60).text
        samples += [s for family in text_string_to_metric_families(text) for s in family.samples]
    return Scrape(samples)


def scrape_until(stack, done: Callable[[Scrape], bool], timeout_s: float = 120.0, every_s: float = 2.0) -> Scrape:
    """Scrapes until ``done(scrape)`` (Ray's agent exports what processes recorded every few
    seconds) or ``timeout_s`` passed; returns the last scrape either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = scrape(stack)
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(every_s)


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def series_of(expr: str) -> set[str]:
    """The series names an expression reads (every series of loraplex's dashboard is ray_...)."""
    return set(DASHBOARD_SERIES.findall(expr))
