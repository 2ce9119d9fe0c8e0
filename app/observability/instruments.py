"""Counters, histograms and gauges of ``app.observability.series``, recorded through Ray's metrics
agent in a Ray worker and in a process-local prometheus_client registry elsewhere.

The backend is chosen at an instrument's first record (``ray.is_initialized()``) and kept. Ray's
agent on each node exports what every process of the node recorded (``Series.exported`` names);
``LOCAL`` serves processes outside Ray (tests, tools) and is exported by nothing. Recording never
raises: a failing backend is logged once and the record dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from app.observability.series import Series

logger = logging.getLogger(__name__)
LOCAL = CollectorRegistry()


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except Exception:
        return False


class _RayBackend:
    def __init__(self, s: Series) -> None:
        from ray.util import metrics as rm

        if s.kind == "counter":
            self.metric = rm.Counter(s.name, s.help, tag_keys=s.tags)
            self.record = lambda value, tags: self.metric.inc(value, tags=tags)
        elif s.kind == "histogram":
            self.metric = rm.Histogram(s.name, s.help, boundaries=list(s.buckets), tag_keys=s.tags)
            self.record = lambda value, tags: self.metric.observe(value, tags=tags)
        else:
            self.metric = rm.Gauge(s.name, s.help, tag_keys=s.tags)
            self.record = lambda value, tags: self.metric.set(value, tags=tags)


class _LocalBackend:
    def __init__(self, s: Series) -> None:
        if s.kind == "counter":
            self.metric = PromCounter(s.name, s.help, s.tags, registry=LOCAL)
            self.record = lambda value, tags: self.metric.labels(**tags).inc(value)
        elif s.kind == "histogram":
            self.metric = PromHistogram(s.name, s.help, s.tags, buckets=s.buckets, registry=LOCAL)
            self.record = lambda value, tags: self.metric.labels(**tags).observe(value)
        else:
            self.metric = PromGauge(s.name, s.help, s.tags, registry=LOCAL)
            self.record = lambda value, tags: self.metric.labels(**tags).set(value)


class Instrument:
    """One series' recorder: ``record(value, tags)`` adds (counter), observes (histogram) or sets
    (gauge); ``tags`` must name exactly the series' tags, values as strings."""

    def __init__(self, series: Series) -> None:
        self.series = series
        self._backend: _RayBackend | _LocalBackend | None = None
        self._broken = False

    def record(self, value: float, tags: Mapping[str, str]) -> None:
        if self._broken:
            return
        try:
            if self._backend is None:
                self._backend = _RayBackend(self.series) if _in_ray_worker() else _LocalBackend(self.series)
            self._backend.record(value, tags)
        except Exception as exc:  # metrics must never fail a request
            self._broken = True
            logger.warning("metric %s disabled: %s: %s", self.series.name, type(exc).__name__, exc)


_instruments: dict[str, Instrument] = {}


def instrument(series: Series) -> Instrument:
    """The process's one recorder of ``series``."""
    found = _instruments.get(series.name)
    if found is None:
        found = _instruments[series.name] = Instrument(series)
    return found
