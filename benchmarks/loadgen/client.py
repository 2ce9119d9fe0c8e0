"""The closed loop: streaming requests over one keep-alive connection pool, each measured from send to end.

The client is aiohttp (as vLLM's own ``vllm bench serve``): its request costs a fraction of
httpx's, so a burst of requests (every worker of a closed loop sends its next when a wave of
equal-length requests ends together) leaves the client within a few ms instead of being spread
over tens of ms by the client itself, which the server's figures would then carry. Every body
of a phase is built and encoded before the phase starts (``encoded_bodies``), as the in-process
engine target builds its prompts (``benchmarks.loadgen.engine_target``), so a worker's next
request leaves as soon as its last one ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import aiohttp

from benchmarks.loadgen.closed_loop import run_workers
from benchmarks.loadgen.spec import LoadResult, LoadSpec, RequestRecord
from benchmarks.loadgen.sse import (
    ERROR_BODY_CHARS,
    StreamState,
    finish_record,
    read_stream,
)
from benchmarks.loadgen.stats import aggregate
from benchmarks.loadgen.workload import model_sequence, request_body
from benchmarks.progress import progress_bar

CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError)


async def sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The response body's lines, decoded, line endings stripped, as they arrive."""
    async for raw in resp.content:
        yield raw.decode().rstrip("\r\n")


def encoded_bodies(spec: LoadSpec, phase: str, models: list[str | None]) -> list[bytes]:
    """The JSON body of request ``i`` of ``phase`` (its model ``models[i]``), encoded, for every ``i``."""
    return [json.dumps(request_body(spec, spec.target.model_name(adapter), phase, i)).encode()
            for i, adapter in enumerate(models)]


async def send_one(session: aiohttp.ClientSession, spec: LoadSpec, phase: str, index: int,
                   adapter: str | None, t_phase: float, state: StreamState | None = None,
                   data: bytes | None = None) -> RequestRecord:
    """Sends one streaming request and measures it (its chunks into ``state`` when given);
    ``data``: its encoded body when built beforehand (``encoded_bodies``)."""
    model = spec.target.model_name(adapter)
    if data is None:
        data = json.dumps(request_body(spec, model, phase, index)).encode()
    key = spec.target.key_for(adapter, index)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    url = spec.target.base_url.rstrip("/") + path
    state = state if state is not None else StreamState(spec.endpoint)
    t_send = time.perf_counter()
    rec = RequestRecord(index=index, adapter=adapter, model=model, start_s=t_send - t_phase, status=None,
                        ok=False, expected_output_tokens=spec.output_len)
    try:
        async with session.post(url, data=data, headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.read()).decode(errors="replace")[:ERROR_BODY_CHARS]
                rec.e2e_ms = (time.perf_counter() - t_send) * 1000
                return rec
            await read_stream(sse_lines(resp), state)
    except CLIENT_ERRORS as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
        rec.e2e_ms = (time.perf_counter() - t_send) * 1000
        return rec
    return finish_record(rec, state, t_send, time.perf_counter())


# ---- phases ----------------------------------------------------------------------------------
async def closed_loop(session: aiohttp.ClientSession, spec: LoadSpec, phase: str,
                      models: list[str | None]) -> tuple[list[RequestRecord], float]:
    """``spec.concurrency`` workers send the requests of ``models`` one after another
    (``closed_loop.run_workers``); the records in index order and the wall time."""
    bodies = encoded_bodies(spec, phase, models)
    bar = progress_bar(len(models), f"{phase} c={spec.concurrency}")

    async def send(index: int, adapter: str | None, t0: float, state: StreamState | None) -> RequestRecord:
        return await send_one(session, spec, phase, index, adapter, t0, state, bodies[index])

    try:
        return await run_workers(spec, models, send, on_record=lambda _: bar.update())
    finally:
        bar.close()


async def run_load(spec: LoadSpec) -> LoadResult:
    """Warm-up (every model in turn, not counted), then the measured closed loop."""
    connector = aiohttp.TCPConnector(limit=spec.concurrency, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=spec.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm, _ = await closed_loop(session, spec, "warmup",
                                    model_sequence(spec, "warmup", spec.warmup_requests, "round-robin"))
        records, wall = await closed_loop(session, spec, "measure",
                                          model_sequence(spec, "measure", spec.num_requests, spec.popularity))
    return LoadResult(system=spec.target.name, spec=spec, warmup_requests=len(warm),
                      warmup_failures=sum(not r.ok for r in warm), records=records,
                      aggregate=aggregate(records, wall))


def run(spec: LoadSpec) -> LoadResult:
    """``run_load`` from synchronous code."""
    return asyncio.run(run_load(spec))


def raise_priority() -> bool:
    """On a machine of few cores a normal-priority client is starved by the engine and sees all
    tokens at the end; run it real-time when allowed. Called after the stack has started, so the
    stack keeps its normal priority; children started afterwards (vllm bench) inherit it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (PermissionError, AttributeError, OSError):
        return False
