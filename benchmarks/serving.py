"""Serving-layer overhead: loraplex (gateway + router + Ray Serve hop) vs vLLM's own OpenAI server.

Both serve the embedded model with the same engine settings and the same adapter, one after the
other on this machine; requests are sequential (concurrency 1) so the difference is the serving
layer, not the engine. Measured per request: TTFT (streaming, first content chunk) and the full
latency of a 1-token non-streaming completion. A third scenario cycles loraplex through twice as
many adapters as a replica holds (every request evicts one and loads another from the store):
the cost of a working set larger than the slots. Prints a side-by-side table.

    .venv/bin/python benchmarks/serving.py [--requests 40]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.net import free_port  # noqa: E402
from tests.helpers.stack import start_stack, stop_stack  # noqa: E402

ADAPTER = "acme-support"
SLOTS = 4  # residency capacity (max_cpu_loras) of the loraplex replica in this benchmark
PROMPT = "please route 42 requests to the expert"


def _raise_priority() -> None:
    """On 2 cores a normal-priority client is starved by the engine; run it real-time when allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, AttributeError, OSError):
        pass


def _first_chunk_after(response: httpx.Response, t0: float) -> float:
    """Seconds from ``t0`` to the first SSE data chunk; drains the rest of the stream."""
    first = None
    for line in response.iter_lines():
        if first is None and line.startswith("data: {"):
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("stream ended without a data chunk")
    return first


def measure(base_url: str, headers: dict, model: str, n: int) -> dict[str, list[float]]:
    ttft, full = [], []
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        for _ in range(3):  # warm-up (adapter load, first compile)
            c.post("/v1/completions", json={**body, "max_tokens": 1}).raise_for_status()
        for _ in range(n):
            t0 = time.perf_counter()
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                r.raise_for_status()
                ttft.append(_first_chunk_after(r, t0))
            t0 = time.perf_counter()
            c.post("/v1/completions", json={**body, "max_tokens": 1}).raise_for_status()
            full.append(time.perf_counter() - t0)
    return {"ttft": ttft, "one_token": full}


def publish_working_set(home: Path, n: int) -> list[str]:
    """``n`` extra attention adapters of tenant acme in the local store (distinct random weights)."""
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.setup import model_dir

    store = open_store((home / "store").as_uri())
    base = BaseModelInfo.from_model_dir(model_dir(home))
    ids = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            src = build_peft_adapter(model_dir(home), Path(tmp), "attention", 8, 1000 + i)
            ids.append(store.publish(src, f"ws-{i}", "acme", base).adapter_id)
    return ids


def measure_rotation(base_url: str, headers: dict, adapter_ids: list[str], rounds: int) -> dict[str, list[float]]:
    """TTFT while cycling through ``adapter_ids`` (more than the slots: each request is a cold load)."""
    ttft = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        for _ in range(rounds):
            for model in adapter_ids:
                t0 = time.perf_counter()
                with c.stream("POST", "/v1/completions",
                              json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
                    r.raise_for_status()
                    ttft.append(_first_chunk_after(r, t0))
    return {"ttft": ttft, "one_token": []}


def start_vllm_server(home: Path, log: Path, adapter_ids: list[str]) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server with the same engine settings, the adapters preloaded from the local store."""
    from adapters_registry.stores import open_store
    from app.embedded.setup import model_dir

    store = open_store((home / "store").as_uri())
    modules = [f"{a}={home / 'store' / a / str(store.get(a).version)}" for a in adapter_ids]
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir(home)),
        "--served-model-name", "loraplex-base", "--dtype", "float32", "--max-model-len", "1024",
        "--max-num-seqs", "16", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", str(SLOTS),
        "--max-lora-rank", "64", "--lora-modules", *modules,
        "--host", "127.0.0.1", "--port", str(port),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited; see {log}")
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "loraplex-base", "prompt": "x", "max_tokens": 1}, timeout=30)
            if r.status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise RuntimeError("vLLM server not ready")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    _raise_priority()
    from app.embedded.setup import demo_keys, init

    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    home = init(work / "home", progress=False)
    results = {}
    working_set = publish_working_set(home, 2 * SLOTS)
    rounds = max(1, args.requests // len(working_set))
    proc, url = start_vllm_server(home, work / "vllm.log", [ADAPTER, *working_set])
    try:
        for model in ("loraplex-base", ADAPTER):
            results[("vLLM OpenAI server", model)] = measure(url, {}, model, args.requests)
        results[(f"vLLM, {len(working_set)} adapters > {SLOTS} slots", "round-robin")] = measure_rotation(url, {}, working_set, rounds)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    stack = start_stack(home, work, {"engine": {"max_loras": 2, "max_cpu_loras": SLOTS}})
    try:
        headers = {"Authorization": f"Bearer {demo_keys(home)['acme']}"}
        for model in ("loraplex-base", ADAPTER):
            results[("loraplex (gateway+router+Serve)", model)] = measure(stack.base_url, headers, model, args.requests)
        rotation = measure_rotation(stack.base_url, headers, working_set, rounds)
        results[(f"loraplex, {len(working_set)} adapters > {SLOTS} slots", "round-robin")] = rotation
    finally:
        stop_stack(stack)

    print(f"\n{time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} CPUs  requests={args.requests} sequential")
    print(f"{'server':34} {'model':14} {'TTFT p50':>10} {'TTFT p90':>10} {'1-tok p50':>11} {'1-tok p90':>11}")
    for (server, model), r in results.items():
        one = f"{pct(r['one_token'], .5):9.1f}ms {pct(r['one_token'], .9):9.1f}ms" if r["one_token"] else f"{'-':>11} {'-':>11}"
        print(f"{server:34} {model:14} {pct(r['ttft'], .5):8.1f}ms {pct(r['ttft'], .9):8.1f}ms {one}")
    for model in ("loraplex-base", ADAPTER):
        a = results[("vLLM OpenAI server", model)]
        b = results[("loraplex (gateway+router+Serve)", model)]
        print(f"added by loraplex, {model}: TTFT p50 {pct(b['ttft'], .5) - pct(a['ttft'], .5):+.1f} ms, "
              f"1-token p50 {pct(b['one_token'], .5) - pct(a['one_token'], .5):+.1f} ms")


if __name__ == "__main__":
    main()
