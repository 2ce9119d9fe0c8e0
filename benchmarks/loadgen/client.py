"""The closed loop: streaming requests over one keep-alive connection pool, each measured from send to end."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

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


async def send_one(client: httpx.AsyncClient, spec: LoadSpec, phase: str, index: int,
                   adapter: str | None, t_phase: float, state: StreamState | None = None) -> RequestRecord:
    """Sends one streaming request and measures it (its chunks into ``state`` when given)."""
    model = spec.target.model_name(adapter)
    body = request_body(spec, model, phase, index)
    key = spec.target.key_for(adapter, index)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    state = state if state is not None else StreamState(spec.endpoint)
    t_send = time.perf_counter()
    rec = RequestRecord(index=index, adapter=adapter, model=model, start_s=t_send - t_phase, status=None,
                        ok=False, expected_output_tokens=spec.output_len)
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:ERROR_BODY_CHARS]
                rec.e2e_ms = (time.perf_counter() - t_send) * 1000
                return rec
            await read_stream(resp, state)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
        rec.e2e_ms = (time.perf_counter() - t_send) * 1000
        return rec
    return finish_record(rec, state, t_send, time.perf_counter())


# ---- phases ----------------------------------------------------------------------------------
async def closed_loop(client: httpx.AsyncClient, spec: LoadSpec, phase: str,
                      models: list[str | None]) -> tuple[list[RequestRecord], float]:
    """``spec.concurrency`` workers send the requests of ``models`` one after another
    (``closed_loop.run_workers``); the records in index order and the wall time."""
    bar = progress_bar(len(models), f"{phase} c={spec.concurrency}")

    async def send(index: int, adapter: str | None, t0: float, state: StreamState | None) -> RequestRecord:
        return await send_one(client, spec, phase, index, adapter, t0, state)

    try:
        return await run_workers(spec, models, send, on_record=lambda _: bar.update())
    finally:
        bar.close()


async def run_load(spec: LoadSpec) -> LoadResult:
    """Warm-up (every model in turn, not counted), then the measured closed loop."""
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency,
                          keepalive_expiry=60)
    timeout = httpx.Timeout(spec.timeout_s, connect=30)
    async with httpx.AsyncClient(base_url=spec.target.base_url, limits=limits, timeout=timeout,
                                 http1=True, http2=False) as client:
        warm, _ = await closed_loop(client, spec, "warmup",
                                    model_sequence(spec, "warmup", spec.warmup_requests, "round-robin"))
        records, wall = await closed_loop(client, spec, "measure",
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
