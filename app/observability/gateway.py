"""What the gateway records per request: outcome and duration, queue time, admission rejections,
and one request log line.

``GatewayRecorder.request(kind, request_id)`` starts a ``GatewayRequest``; the ingress fills in
the tenant and adapter as it resolves them, calls ``dispatched()`` when the request leaves for an
engine replica, ``rejected(reason)`` when admission refuses it, and ``finish(status)`` once at
the end (for a stream: when its last byte went out). Only ``finish`` writes the outcome series.
"""

from __future__ import annotations

import time

from app.logging_json import RequestLog, emit
from app.observability import series
from app.observability.config import ObservabilityConfig
from app.observability.instruments import instrument
from app.observability.labels import UNKNOWN, Labels

CLIENT_CLOSED = 499  # the client went away before the response ended (nginx's convention)


class GatewayRecorder:
    """The gateway process's instruments, label caps and log switch."""

    def __init__(self, cfg: ObservabilityConfig) -> None:
        self.labels = Labels(cfg)
        self.request_logs = cfg.request_logs
        self.requests = instrument(series.REQUESTS)
        self.duration = instrument(series.REQUEST_DURATION)
        self.queue = instrument(series.GATEWAY_QUEUE)
        self.rejections = instrument(series.ADMISSION_REJECTIONS)

    def request(self, kind: str, request_id: str) -> "GatewayRequest":
        return GatewayRequest(self, kind, request_id)


class GatewayRequest:
    """One request's measurements at the gateway (monotonic clock); outcome recorded once."""

    __slots__ = ("rec", "kind", "request_id", "started", "tenant", "adapter", "stream", "replica",
                 "queue_s", "reason", "_finished")

    def __init__(self, rec: GatewayRecorder, kind: str, request_id: str) -> None:
        self.rec = rec
        self.kind = kind
        self.request_id = request_id
        self.started = time.monotonic()
        self.tenant = UNKNOWN
        self.adapter = UNKNOWN
        self.stream = False
        self.replica: str | None = None
        self.queue_s: float | None = None
        self.reason: str | None = None
        self._finished = False

    def _tags(self) -> dict[str, str]:
        return {"tenant": self.rec.labels.tenant(self.tenant), "adapter": self.rec.labels.adapter(self.adapter)}

    def dispatched(self) -> None:
        """The request leaves for an engine replica now."""
        self.queue_s = time.monotonic() - self.started
        self.rec.queue.record(self.queue_s, self._tags())

    def rejected(self, reason: str) -> None:
        """Admission refused the request for ``reason``."""
        self.reason = reason
        self.rec.rejections.record(1, {"tenant": self.rec.labels.tenant(self.tenant), "reason": reason})

    def finish(self, status: int, reason: str | None = None) -> None:
        """Records the outcome (first call only) and writes the request's log line."""
        if self._finished:
            return
        self._finished = True
        duration = time.monotonic() - self.started
        tags = {**self._tags(), "kind": self.kind}
        self.rec.duration.record(duration, tags)
        self.rec.requests.record(1, {**tags, "status": str(status)})
        if self.rec.request_logs:
            emit(RequestLog(
                component="gateway", request_id=self.request_id,
                tenant=None if self.tenant == UNKNOWN else self.tenant,
                adapter=None if self.adapter == UNKNOWN else self.adapter,
                kind=self.kind, stream=self.stream, status=status, replica=self.replica,
                reason=self.reason or reason, queue_s=self.queue_s, duration_s=duration,
            ))
