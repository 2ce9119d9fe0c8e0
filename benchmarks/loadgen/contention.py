"""Two tenants on one service: a flood of concurrent long streams, and probes (one short
streaming request at a time) whose TTFT is what contention costs the polite tenant.

``Flood`` keeps ``concurrency`` streams open (each sends the next when its stream ends) until
stopped, counting the output tokens it receives (vLLM's per-chunk usage, asked for with
``continuous_usage_stats``), so its token rate over any window is known (``tokens`` read at both
ends). ``probe`` sends ``n`` requests one after another, ``pause_s``
apart, and measures each as ``benchmarks.loadgen.client`` does (TTFT: send to the first content
chunk). Both note which gateway replica answered (``x-loraplex-gateway``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import httpx
from pydantic import BaseModel, Field

from benchmarks.loadgen.spec import RequestRecord
from benchmarks.loadgen.sse import StreamState, finish_record, read_stream

GATEWAY_HEADER = "x-loraplex-gateway"
COMPLETIONS = "/v1/completions"
COMPLETION_TOKENS = re.compile(r'"completion_tokens":(\d+)')


class ProbeRecord(BaseModel):
    """One probe request."""

    record: RequestRecord = Field(description="Its timings (TTFT, e2e) and status.")
    gateway: str | None = Field(None, description="The gateway replica that answered.")


class Flood:
    """``concurrency`` streams of ``body`` with ``key`` until ``stop()``."""

    def __init__(self, client: httpx.AsyncClient, key: str, body: dict, concurrency: int) -> None:
        usage = {"include_usage": True, "continuous_usage_stats": True}
        self.client, self.key, self.concurrency = client, key, concurrency
        self.body = {**body, "stream": True, "stream_options": usage}
        self.tokens = 0
        self.streams_done = 0
        self.open = 0
        self.statuses: Counter = Counter()
        self.gateways: Counter = Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> "Flood":
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]
        return self

    async def _worker(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        while not self._stop.is_set():
            try:
                async with self.client.stream("POST", COMPLETIONS, json=self.body, headers=headers) as resp:
                    self.statuses[resp.status_code] += 1
                    self.gateways[resp.headers.get(GATEWAY_HEADER)] += 1
                    if resp.status_code != 200:
                        await resp.aread()
                        await asyncio.sleep(0.2)
                        continue
                    self.open += 1
                    seen = 0
                    try:
                        async for line in resp.aiter_lines():
                            if (m := COMPLETION_TOKENS.search(line)) is not None:
                                n = int(m.group(1))
                                self.tokens += max(0, n - seen)
                                seen = max(seen, n)
                            if self._stop.is_set():
                                break
                    finally:
                        self.open -= 1
                self.streams_done += 1
            except httpx.HTTPError:
                self.statuses["error"] += 1
                await asyncio.sleep(0.2)

    async def wait_streaming(self, timeout_s: float = 120) -> None:
        """Until every stream has started producing tokens."""
        deadline = time.monotonic() + timeout_s
        while self.open < self.concurrency or self.tokens < self.concurrency:
            if time.monotonic() > deadline:
                raise TimeoutError(f"flood: {self.open} of {self.concurrency} streams open after {timeout_s} s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def probe_once(client: httpx.AsyncClient, key: str, body: dict, index: int) -> ProbeRecord:
    """One streaming request, measured."""
    rec = RequestRecord(index=index, adapter=None, model=str(body.get("model")), start_s=0.0, status=None,
                        ok=False, expected_output_tokens=int(body.get("max_tokens") or 0))
    state = StreamState("completions")
    t_send = time.perf_counter()
    gateway = None
    try:
        async with client.stream("POST", COMPLETIONS, json={**body, "stream": True},
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            rec.status, gateway = resp.status_code, resp.headers.get(GATEWAY_HEADER)
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:500]
                return ProbeRecord(record=rec, gateway=gateway)
            await read_stream(resp.aiter_lines(), state)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return ProbeRecord(record=rec, gateway=gateway)
    return ProbeRecord(record=finish_record(rec, state, t_send, time.perf_counter()), gateway=gateway)


async def probe(client: httpx.AsyncClient, key: str, body: dict, n: int, pause_s: float) -> list[ProbeRecord]:
    """``n`` probes one after another, ``pause_s`` apart."""
    out = []
    for i in range(n):
        out.append(await probe_once(client, key, body, i))
        await asyncio.sleep(pause_s)
    return out
