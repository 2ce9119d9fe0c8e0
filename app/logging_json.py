"""Request logs as JSON, one object per line on stderr, written by a thread off the event loop.

``RequestLog`` is the record's shape. ``emit(record)`` hands it to the ``loraplex.requests``
logger, whose ``QueueHandler`` only enqueues; a ``QueueListener`` thread does the write. In a Ray
worker stderr goes to the worker's log file and to the driver (``serve run``'s output). Never
part of a record: prompts, messages, outputs, API keys, headers or request bodies.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import Literal, TextIO

from pydantic import BaseModel, Field

LOGGER_NAME = "loraplex.requests"


class RequestLog(BaseModel):
    """One request as the gateway or an engine replica saw it (absent fields are not known there)."""

    ts: float = Field(default_factory=time.time, description="Unix time the record was made (the request's end).")
    component: Literal["gateway", "engine"] = Field(description="Which part of the serving path wrote it.")
    request_id: str = Field(description="The request id (client's x-request-id or made by the proxy).")
    tenant: str | None = Field(None, description="Authenticated tenant.")
    adapter: str | None = Field(None, description="Resolved adapter id, or the base model's served name.")
    kind: str | None = Field(None, description="chat or completion.")
    stream: bool | None = Field(None, description="Whether the response was streamed.")
    status: int = Field(description="Outcome status (as loraplex_requests counts it).")
    replica: str | None = Field(None, description="Engine replica that served the request.")
    reason: str | None = Field(None, description="Why it was refused or failed (admission reason or error type).")
    queue_s: float | None = Field(None, description="Gateway: arrival to dispatch to the engine.")
    duration_s: float | None = Field(None, description="Arrival to the last byte (gateway) or to the end (engine).")
    ttft_s: float | None = Field(None, description="Engine: arrival at the replica to the first generated token.")
    to_engine_s: float | None = Field(None, description="Engine: arrival at the replica to vLLM's engine taking the "
                                      "request (adapter made resident, body parsed, vLLM's serving layer).")
    engine_queue_s: float | None = Field(None, description="Engine: queued in vLLM's scheduler until first scheduled.")
    prefill_s: float | None = Field(None, description="Engine: first scheduled to the first generated token.")
    adapter_load: dict[str, float] | None = Field(
        None, description="Engine: the adapter load this request waited for, seconds per step: disk_s (download and "
        "verify, or a disk-cache hit; an evicted adapter unregistered first), checks_s (validation against this "
        "engine), add_lora_s (vLLM registering it).")
    prompt_tokens: int | None = Field(None, description="Engine: prompt tokens.")
    generation_tokens: int | None = Field(None, description="Engine: generated tokens.")


_lock = threading.Lock()
_logger: logging.Logger | None = None


def request_logger(stream: TextIO | None = None) -> logging.Logger:
    """The ``loraplex.requests`` logger, set up once per process (queue handler + writer thread).

    Lines go to ``stream`` where the first call names one, else to the process's own stderr
    (``sys.__stderr__``): Serve's throughput-optimized mode points a replica's ``sys.stderr``
    at its file logger, which would take the lines out of the worker's stderr that Ray forwards."""
    global _logger
    with _lock:
        if _logger is None:
            q: queue.SimpleQueue = queue.SimpleQueue()
            out = logging.StreamHandler(stream if stream is not None else (sys.__stderr__ or sys.stderr))
            out.setFormatter(logging.Formatter("%(message)s"))
            listener = logging.handlers.QueueListener(q, out)
            listener.start()  # a daemon thread: it ends with the process
            log = logging.getLogger(LOGGER_NAME)
            log.addHandler(logging.handlers.QueueHandler(q))
            log.setLevel(logging.INFO)
            log.propagate = False  # one line in our format, not another in Serve's
            _logger = log
    return _logger


def emit(record: RequestLog) -> None:
    """Queues ``record`` as one JSON line (never blocks on the write)."""
    request_logger().info(record.model_dump_json(exclude_none=True))
