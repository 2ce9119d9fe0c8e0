"""How spread out a closed loop's bursts reach a server when the client alone is the cause: the
load generator's client (``benchmarks.loadgen.client``: aiohttp, every body of the phase built
before it starts) against the client it replaced (httpx, each body built as its request is sent),
side by side on one host, against a stand-in server that does no work.

The stand-in (a child process, raw asyncio) records when each request's headers arrived
(``time.monotonic``, comparable across processes) and streams ``--chunks`` completion chunks,
``--chunk-ms`` apart, then ``[DONE]``, so every request of a wave ends together and the workers
send the next wave at once, as against a real server with equal-length requests. Per client:
the median over the waves (the first left out) of the first-to-last arrival of a wave, and the
client's CPU ms per request (its process time over the requests).

    python -m benchmarks.loadgen.burst_spread [--concurrency 16] [--waves 8] [--input-len 1600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.loadgen.client import closed_loop
from benchmarks.loadgen.closed_loop import run_workers
from benchmarks.loadgen.spec import LoadSpec, RequestRecord, TargetSpec
from benchmarks.loadgen.sse import ERROR_BODY_CHARS, StreamState, finish_record, read_stream
from benchmarks.loadgen.workload import request_body
from benchmarks.stacks.process import free_port

CLIENTS = ("aiohttp", "httpx")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":%d}}\n\n'
LABELS = {"aiohttp": "aiohttp, bodies built before the phase (the load generator)",
          "httpx": "httpx, each body built as it is sent (before)"}


# ---- the stand-in server (a child process) ------------------------------------------------------
async def _serve(port: int, chunks: int, chunk_s: float, arrivals: Path) -> None:
    seen: list[float] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(time.monotonic())
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(HEAD)
                for i in range(chunks):
                    event = EVENT % (i + 1)
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(chunk_s)
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
                partial = arrivals.with_suffix(".partial")
                partial.write_text(json.dumps(seen))
                partial.replace(arrivals)  # whole, for the client that reads it
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


# ---- the httpx client it replaced (the baseline) ------------------------------------------------
async def _httpx_closed_loop(spec: LoadSpec, models: list[str | None]) -> None:
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=spec.target.base_url, limits=limits, timeout=60) as client:
        async def send(index, adapter, t_phase, state):
            body = request_body(spec, spec.target.model_name(adapter), "measure", index)
            state = state if state is not None else StreamState(spec.endpoint)
            t_send = time.perf_counter()
            rec = RequestRecord(index=index, adapter=adapter, model="m", start_s=t_send - t_phase, status=None,
                                ok=False, expected_output_tokens=spec.output_len)
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    rec.error = (await resp.aread()).decode(errors="replace")[:ERROR_BODY_CHARS]
                    return rec
                await read_stream(resp.aiter_lines(), state)
            return finish_record(rec, state, t_send, time.perf_counter())

        await run_workers(spec, models, send)


async def _aiohttp_closed_loop(spec: LoadSpec, models: list[str | None]) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=spec.concurrency)) as session:
        await closed_loop(session, spec, "measure", models)


def measure(client: str, spec: LoadSpec, arrivals: Path) -> dict[str, float]:
    """One client's closed loop of ``spec`` against the stand-in: wave spread and CPU per request."""
    models: list[str | None] = [None] * spec.num_requests
    arrivals.write_text("[]")
    cpu = time.process_time()
    asyncio.run((_aiohttp_closed_loop if client == "aiohttp" else _httpx_closed_loop)(spec, models))
    cpu = time.process_time() - cpu
    seen = json.loads(arrivals.read_text())[-spec.num_requests:]
    n = spec.concurrency
    waves = [seen[i:i + n] for i in range(n, len(seen) - n + 1, n)]  # the first wave left out
    spreads = [(w[-1] - w[0]) * 1e3 for w in waves]
    return {"wave_spread_ms_p50": statistics.median(spreads), "wave_spread_ms_max": max(spreads),
            "client_cpu_ms_per_request": cpu / spec.num_requests * 1e3, "waves": float(len(waves))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1600, help="prompt token ids per request body")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--chunk-ms", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=2, help="runs per client, alternating")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", nargs=2, metavar=("PORT", "ARRIVALS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(int(args.serve[0]), args.chunks, args.chunk_ms / 1e3, Path(args.serve[1])))
        return
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        arrivals = Path(tmp) / "arrivals.json"
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.loadgen.burst_spread", "--chunks", str(args.chunks),
                                   "--chunk-ms", str(args.chunk_ms), "--serve", str(port), str(arrivals)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            target = TargetSpec(name="stand-in", base_url=f"http://127.0.0.1:{port}", base_model="m")
            spec = LoadSpec(target=target, input_len=args.input_len, output_len=args.chunks,
                            concurrency=args.concurrency, num_requests=args.concurrency * args.waves,
                            vocab_size=200_000)
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in CLIENTS}
            for _ in range(args.reps):  # alternating, so a slower stretch of the host hits both
                for c in CLIENTS:
                    runs[c].append(measure(c, spec, arrivals))
        finally:
            server.terminate()
            server.wait(10)
    print(f"{args.concurrency} workers x {args.waves} waves, {args.input_len}-token bodies, {args.chunks} chunks "
          f"{args.chunk_ms} ms apart; median of {args.reps} runs per client")
    print("| client | wave spread p50 ms | wave spread max ms | client CPU ms per request |\n|---|---|---|---|")
    for c in CLIENTS:
        med = {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]}
        print(f"| {LABELS[c]} | {med['wave_spread_ms_p50']:.1f} | {med['wave_spread_ms_max']:.1f} | "
              f"{med['client_cpu_ms_per_request']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
