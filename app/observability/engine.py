"""What an engine replica records per request: time to first token, inter-token latency, prompt
and generated tokens, outcome; and one request log line.

Per request: ``start(meta, kind, stream)`` (None for internal calls such as readiness, which
are not recorded), ``bind(req)`` around the call into vLLM's serving layer, ``finish(req,
status)`` once at the end. While bound, ``current_sink()`` is the request's ``on_output``: the
engine client of ``app.engine.vllm_serving`` calls it with the progress of every output vLLM
yields for the request, so TTFT and ITL are recorded as the tokens come.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from app.logging_json import RequestLog, emit
from app.observability import series
from app.observability.config import ObservabilityConfig
from app.observability.instruments import instrument
from app.observability.labels import Labels
from app.observability.token_timing import OutputProgress, TokenClock
from app.request_meta import RequestMeta

Sink = Callable[[OutputProgress], None]
_current: ContextVar["EngineRequest | None"] = ContextVar("loraplex_engine_request", default=None)


def current_sink() -> Sink | None:
    """The bound request's output callback, or None outside a recorded request."""
    req = _current.get()
    return None if req is None else req.on_output


class EngineRecorder:
    """One replica's instruments and label caps (a replica is one process)."""

    def __init__(self, cfg: ObservabilityConfig, replica: str) -> None:
        self.labels = Labels(cfg)
        self.replica = replica
        self.request_logs = cfg.request_logs
        self.ttft = instrument(series.TIME_TO_FIRST_TOKEN)
        self.itl = instrument(series.INTER_TOKEN_LATENCY)
        self.prompt_tokens = instrument(series.PROMPT_TOKENS)
        self.generation_tokens = instrument(series.GENERATION_TOKENS)
        self.requests = instrument(series.ENGINE_REQUESTS)

    def start(self, meta: dict | None, kind: str, stream: bool) -> "EngineRequest | None":
        return None if meta is None else EngineRequest(self, RequestMeta.model_validate(meta), kind, stream)

    @contextmanager
    def bind(self, req: "EngineRequest | None") -> Iterator[None]:
        token = _current.set(req)
        try:
            yield
        finally:
            _current.reset(token)

    def finish(self, req: "EngineRequest | None", status: int) -> None:
        if req is not None:
            req.finish(status)


class EngineRequest:
    """One request on the replica: its tags, token clock and outcome (recorded once)."""

    __slots__ = ("rec", "meta", "kind", "stream", "tags", "clock", "started", "ttft", "adapter_load", "_finished")

    def __init__(self, rec: EngineRecorder, meta: RequestMeta, kind: str, stream: bool) -> None:
        self.rec = rec
        self.meta = meta
        self.kind = kind
        self.stream = stream
        self.tags = {"tenant": rec.labels.tenant(meta.tenant), "adapter": rec.labels.adapter(meta.adapter),
                     "replica": rec.replica}
        self.clock = TokenClock(time.time())
        self.started = time.monotonic()
        self.ttft: float | None = None
        self.adapter_load: dict[str, float] | None = None  # the adapter load this request waited for, if any
        self._finished = False

    def on_output(self, progress: OutputProgress) -> None:
        step = self.clock.update(progress)
        if step.ttft is not None:
            self.ttft = step.ttft
            self.rec.ttft.record(step.ttft, self.tags)
        for _ in range(step.itl_count):
            self.rec.itl.record(step.itl, self.tags)

    def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        rec, clock = self.rec, self.clock
        if clock.prompt_tokens:
            rec.prompt_tokens.record(clock.prompt_tokens, self.tags)
        if clock.output_tokens:
            rec.generation_tokens.record(clock.output_tokens, self.tags)
        rec.requests.record(1, {**self.tags, "status": str(status)})
        if rec.request_logs:
            emit(RequestLog(
                component="engine", request_id=self.meta.request_id, tenant=self.meta.tenant,
                adapter=self.meta.adapter, kind=self.kind, stream=self.stream, status=status,
                replica=rec.replica, duration_s=time.monotonic() - self.started, ttft_s=self.ttft,
                prompt_tokens=clock.prompt_tokens, generation_tokens=clock.output_tokens,
                to_engine_s=clock.to_engine_s, engine_queue_s=clock.engine_queue_s, prefill_s=clock.prefill_s,
                adapter_load=self.adapter_load,
            ))
