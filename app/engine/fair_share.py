"""Fair share inside one engine replica's batch: VTC tags (``app.vtc``) as vLLM request priorities.

The gateway sends each request's ``TenantShare``; the replica tags it against the counters of
every request it serves (from all gateway replicas) and hands the tag to vLLM as the request's
``priority`` (lower first; the engine runs ``scheduling_policy="priority"`` with loraplex's
preempting scheduler, ``kernels.vllm.scheduling``). A request without a share (fair
share off, readiness probes) gets priority 0, so with fair share off every request is first
come, first served. A ``priority`` a client put in its body is never used.

A heavy tenant — one whose admitted, unserved work here exceeds ``backlog_tokens`` virtual
tokens when a request arrives — gets that stream in chunks of ``stream_interval`` tokens (vLLM's
per-request ``stream_interval``: the first token still goes out at once, the tokens are produced
as fast): relaying a flood chunk by chunk through the engine replica, the gateway and Serve's
proxy costs host CPU every other tenant's requests wait for.

When a request ends, the tokens it was served (prompt + output, from vLLM's usage) correct its
tenant's counter. Streams get ``stream_options.include_usage`` added for that when the client
did not ask for usage; the usage chunk is then dropped before it reaches the client.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from app.vtc import Ticket, VirtualTokenCounters

USAGE_CHUNK_MARK = '"choices":[]'


class TenantShare(BaseModel):
    """What the gateway tells the engine about a request's tenant for fair share."""

    tenant: str = Field(description="Tenant name: requests of one tenant share one counter.")
    weight: float = Field(gt=0, description="Share weight (from the tenant's priority; higher: larger share).")
    estimated_tokens: int = Field(ge=0, description="Prompt estimate plus max_tokens: the cost charged until the request ends.")


class EngineFairShare:
    """The replica's counters; ``admit`` → tag, ``finish`` → correction with tokens served."""

    def __init__(self, backlog_tokens: int | None = None, stream_interval: int = 16) -> None:
        self.counters = VirtualTokenCounters()
        self.backlog_tokens = backlog_tokens
        self.heavy_stream_interval = stream_interval

    def admit(self, share: dict | None) -> Ticket | None:
        """A ticket for a request with ``share`` (a ``TenantShare`` dump), None without one."""
        if share is None:
            return None
        s = TenantShare.model_validate(share)
        return self.counters.admit(s.tenant, s.weight, s.estimated_tokens)

    @staticmethod
    def priority(ticket: Ticket | None) -> int:
        """vLLM priority of the request: its tag (0 without a ticket)."""
        return 0 if ticket is None else int(ticket.tag)

    def stream_interval(self, ticket: Ticket | None) -> int | None:
        """Tokens per streamed chunk for the request (None: vLLM's setting)."""
        if ticket is None or self.backlog_tokens is None or ticket.backlog <= self.backlog_tokens:
            return None
        return self.heavy_stream_interval

    def finish(self, ticket: Ticket | None, served_tokens: int | None) -> None:
        if ticket is not None:
            self.counters.finish(ticket, served_tokens)

    def snapshot(self) -> dict[str, Any]:
        return {"virtual_time": round(self.counters.virtual_time, 1), "ahead_by": self.counters.snapshot(),
                "active": len(self.counters.active)}


def ask_stream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(body, strip)``: the body with ``stream_options.include_usage`` on; ``strip`` is whether
    the client did not ask for usage (its usage chunk is then dropped)."""
    options = dict(body.get("stream_options") or {})
    if options.get("include_usage"):
        return body, False
    options["include_usage"] = True
    return {**body, "stream_options": options}, True


def usage_of_chunk(chunk: str) -> int | None:
    """Total tokens of a stream's final usage chunk (``data: {..."choices":[]..."usage":...}``),
    None for every other chunk."""
    if USAGE_CHUNK_MARK not in chunk or '"usage"' not in chunk or not chunk.startswith("data: {"):
        return None
    try:
        usage = json.loads(chunk[len("data: "):]).get("usage") or {}
    except ValueError:
        return None
    total = usage.get("total_tokens")
    return int(total) if isinstance(total, int) else None


def usage_of_body(body: dict[str, Any]) -> int | None:
    """Total tokens of a non-streaming response body."""
    total = (body.get("usage") or {}).get("total_tokens")
    return int(total) if isinstance(total, int) else None
