"""One stream as it arrives: SSE payloads, content chunks and their tokens, and the record they fill."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from benchmarks.loadgen.spec import RequestRecord

ERROR_BODY_CHARS = 2000


def sse_events(lines: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """SSE ``data`` payloads with the arrival time of their first line (comments, other fields dropped)."""
    events, data, t_first = [], [], 0.0
    for t, line in lines:
        if not line:
            if data:
                events.append((t_first, "\n".join(data)))
            data = []
        elif line.startswith("data:"):
            if not data:
                t_first = t
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append((t_first, "\n".join(data)))
    return events


class StreamState:
    """Content chunks of one stream as they arrive: time, text and cumulative tokens."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.times: list[float] = []
        self.cumulative: list[int | None] = []
        self.tokens_seen: int | None = None
        self.usage_total: int | None = None
        self.prompt_tokens: int | None = None
        self.error: str | None = None
        self.error_status: int | None = None
        self.done = False

    def add(self, t: float, payload: str) -> None:
        """One SSE data payload."""
        if payload.strip() == "[DONE]":
            self.done = True
            return
        obj = json.loads(payload)
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            self.error = json.dumps(obj)[:ERROR_BODY_CHARS]
            code = err.get("code") if isinstance(err, dict) else None
            self.error_status = code if isinstance(code, int) else None
            return
        usage = obj.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            self.tokens_seen = int(usage["completion_tokens"])
            if not obj.get("choices"):
                self.usage_total = self.tokens_seen
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = int(usage["prompt_tokens"])
        if chunk_text(obj, self.endpoint):
            self.times.append(t)
            self.cumulative.append(self.tokens_seen if obj.get("usage") else None)


async def read_stream(lines: AsyncIterator[str], state: StreamState) -> None:
    """Every SSE event of an open streaming response (its ``lines``, line endings stripped) into
    ``state``, each timed at the arrival of its last line."""
    pending: list[tuple[float, str]] = []
    async for line in lines:
        pending.append((time.perf_counter(), line))
        if not line:
            for t, payload in sse_events(pending):
                state.add(t, payload)
            pending = []
    for t, payload in sse_events(pending):
        state.add(t, payload)


def chunk_text(obj: dict[str, Any], endpoint: str) -> str:
    """Text of a completions or chat chunk's first choice ('' when none)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if endpoint == "completions":
        return choices[0].get("text") or ""
    return (choices[0].get("delta") or {}).get("content") or ""


def chunk_tokens(state: StreamState) -> tuple[list[int], str, int]:
    """Tokens carried by each content chunk, their source, and the output token count.

    Per-chunk usage: differences of the cumulative count (tokens of empty-text chunks go to the
    next content chunk). Final usage only: one token each when it equals the chunk count, else
    the tokens after the first chunk spread evenly over the later chunks. No usage: one each."""
    n = len(state.times)
    total = state.usage_total if state.usage_total is not None else state.tokens_seen
    if n and all(c is not None for c in state.cumulative):
        cum = [0] + [int(c) for c in state.cumulative]  # type: ignore[arg-type]
        return [cum[i + 1] - cum[i] for i in range(n)], "usage-per-chunk", total if total is not None else cum[-1]
    if total is None:
        return [1] * n, "chunks", n
    if n == 1:
        return [total], "usage-total", total
    if total <= n:
        return [1] * n, "usage-total", total
    rest, later = total - 1, n - 1
    return [1] + [rest // later + (1 if i < rest % later else 0) for i in range(later)], "usage-total", total


def finish_record(rec: RequestRecord, state: StreamState, t_send: float, t_end: float) -> RequestRecord:
    """Fills a record's timings and counts from a finished stream."""
    ks, source, total = chunk_tokens(state)
    rec.prompt_tokens, rec.output_tokens, rec.token_source = state.prompt_tokens, total, source
    rec.content_chunks, rec.max_chunk_tokens = len(ks), max(ks, default=0)
    rec.e2e_ms = (t_end - t_send) * 1000
    if state.times:
        rec.ttft_ms = (state.times[0] - t_send) * 1000
        for prev, cur, k in zip(state.times, state.times[1:], ks[1:]):
            rec.itl_ms.extend([(cur - prev) * 1000 / k] * k if k > 0 else [])
        decode_tokens, span = sum(ks[1:]), state.times[-1] - state.times[0]
        if decode_tokens > 0 and span > 0:
            rec.tpot_ms, rec.tokens_per_s = span * 1000 / decode_tokens, decode_tokens / span
    if state.error:
        rec.ok, rec.error, rec.status = False, state.error, state.error_status or rec.status
    elif not state.times:
        rec.ok, rec.error = False, "stream ended without a content chunk"
    elif not state.done:
        rec.ok, rec.error = False, "stream closed before data: [DONE]"
    else:
        rec.ok = True
    return rec
