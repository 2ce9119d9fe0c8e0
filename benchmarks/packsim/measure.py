"""Measures one engine replica on this machine and writes the packing simulation's calibration.

The engine deployment's class runs in this process (no Ray, no HTTP: the path's overhead comes
from ``benchmarks/RESULTS.md``, section serving-overhead), on the embedded model with
``deploy/config.yaml``'s engine settings. Measured, each a median:

- ``replica_start_s``: the engine replica's constructor (vLLM start included) until it returns;
- ``step_ms[b]``: ``b`` concurrent streams of ``--tokens`` tokens: (last chunk - first chunk) /
  (tokens - 1) per stream;
- ``first_token_ms``: one short streaming request on the idle engine;
- ``prefill_ms_per_token``: (first token of a 512-token prompt - of an 8-token one) / 504;
- ``adapter_load_ms``: first token of a request whose adapter is not registered (its files in the
  disk cache: how swaps happen once the working set exceeds the slots) minus of one whose adapter
  is; ``--adapters`` synthetic rank-8 attention adapters cycled through ``max_cpu_loras`` slots;
- ``adapter_stall_ms``: while one stream runs, a request with an unregistered adapter arrives:
  the stream's largest gap between chunks then, minus its median gap.

    python -m benchmarks.packsim.measure --out benchmarks/packsim/calibration_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.packsim.calibration import Calibration

REPO = Path(__file__).resolve().parents[2]
PATH_OVERHEAD_MS = 21.9
PATH_OVERHEAD_SOURCE = ("benchmarks/RESULTS.md, serving-overhead (2026-11-29, this 2-core VM): loraplex TTFT p50 "
                        "29.5 ms vs vLLM's own server 7.6 ms, base model, concurrency 1")
BATCHES = (1, 2, 4, 8, 16)


async def _stream(server, body: dict, manifest: dict | None = None) -> list[float]:
    """Arrival times of the chunks of one streaming completion."""
    times = []
    async for item in server.generate_stream("completion", {**body, "stream": True}, manifest):
        if isinstance(item, dict):
            assert item["status"] == 200, item
        elif item.startswith("data: {"):
            times.append(time.perf_counter())
    return times


async def _ttft(server, body: dict, manifest: dict | None = None) -> float:
    t0 = time.perf_counter()
    times = await _stream(server, body, manifest)
    return (times[0] - t0) * 1000


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _body(prompt, tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}


async def measure(server, manifests: list[dict], tokens: int, reps: int) -> dict:
    out: dict = {"step_ms": {}}
    for _ in range(3):
        await _stream(server, _body("warm up", 16))
    for b in BATCHES:
        steps = []
        for _ in range(reps):
            runs = await asyncio.gather(*(_stream(server, _body(f"batch {i}", tokens)) for i in range(b)))
            steps += [(t[-1] - t[0]) * 1000 / (len(t) - 1) for t in runs if len(t) > 1]
        out["step_ms"][b] = statistics.median(steps)
    short = [await _ttft(server, _body([7] * 8, 1)) for _ in range(10)]
    long = [await _ttft(server, _body([7] * 512, 1)) for _ in range(10)]
    out["first_token_ms"] = statistics.median(short)
    out["prefill_ms_per_token"] = max(0.0, (statistics.median(long) - out["first_token_ms"]) / 504)
    for m in manifests:  # every adapter once: its files reach the disk cache
        await _ttft(server, _body("hello", 1), m)
    cold, warm = [], []
    for m in manifests * reps:  # more adapters than slots: each first use is a load from disk
        cold.append(await _ttft(server, _body("hello", 1), m))
        warm.append(await _ttft(server, _body("hello", 1), m))
    out["adapter_load_ms"] = max(0.0, statistics.median(cold) - statistics.median(warm))
    stalls = []
    for m in manifests[:reps]:
        await _ttft(server, _body("hello", 1), manifests[-1])  # m is evicted by now or soon
        stream = asyncio.create_task(_stream(server, _body("long", 200)))
        await asyncio.sleep(0.2)
        await _ttft(server, _body("hello", 1), m)
        t = await stream
        gaps = [b - a for a, b in zip(t, t[1:])]
        stalls.append((max(gaps) - statistics.median(gaps)) * 1000)
    out["adapter_stall_ms"] = max(0.0, statistics.median(stalls))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="calibration JSON to write")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream when timing steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=8, help="synthetic adapters cycled (more than the slots)")
    args = ap.parse_args(argv)

    import torch
    import vllm

    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.setup import init, model_dir
    from app.engine.server import EngineServer
    from benchmarks.synthetic_adapters import synthetic_adapter

    work = Path(tempfile.mkdtemp(prefix="loraplex-calibrate-"))
    home = init(work / "home", progress=False)
    store = open_store((work / "store").as_uri())
    base = BaseModelInfo.from_model_dir(model_dir(home))
    manifests = [store.publish(synthetic_adapter(work / f"src{i}", base, r=8, seed=i), f"cal{i}", "acme", base)
                 .model_dump(mode="json") for i in range(args.adapters)]
    engine = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())["applications"][0]["args"]["engine"]
    engine["model"] = str(model_dir(home))
    config = {"store_uri": (work / "store").as_uri(), "cache_dir": str(work / "cache"), "engine": engine}
    loop = asyncio.new_event_loop()
    server = EngineServer.__new__(EngineServer)
    t0 = time.perf_counter()
    loop.run_until_complete(server.__init__(config))
    start_s = time.perf_counter() - t0
    try:
        figures = loop.run_until_complete(measure(server, manifests, args.tokens, args.reps))
    finally:
        async def shutdown():
            server.__del__()

        loop.run_until_complete(shutdown())
    cal = Calibration(
        source=(f"python -m benchmarks.packsim.measure {' '.join(argv or sys.argv[1:])}; "
                f"{time.strftime('%Y-%m-%d %H:%M')}; {_cpu()}, {os.cpu_count()} CPUs; Python "
                f"{platform.python_version()}, torch {torch.__version__}, vLLM {vllm.__version__}; embedded model, "
                "deploy/config.yaml engine settings"),
        batch_capacity=engine["max_num_seqs"], adapter_slots=engine["max_cpu_loras"], replica_start_s=start_s,
        path_overhead_ms=PATH_OVERHEAD_MS, path_overhead_source=PATH_OVERHEAD_SOURCE, **figures)
    Path(args.out).write_text(cal.model_dump_json(indent=1) + "\n")
    print(cal.model_dump_json(indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
