"""CUDA-graph timing shared by the kernel benchmarks and the tuners, and the tuners' common
command line and provenance record."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def log(*a) -> None:
    print(*a, flush=True)


def idle_host_us(fn, calls: int) -> float:
    """Median CPU µs of issuing ``fn(i)`` for ``i`` in ``range(calls)``, the GPU idle at each
    call (synchronised before it): what the host spends, not what the GPU runs."""
    times = []
    for i in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def graph_us(fn, n_layers: int, trials: int = 20) -> float:
    """Median µs per layer of replaying a CUDA graph of ``fn()`` (which runs n_layers layers)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        keep = fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del keep, g
    return statistics.median(ts) * 1e3 / n_layers


def tuner_arguments(description: str, models, ms_default: str, out_default: str
                    ) -> argparse.ArgumentParser:
    """The options both tuners take: model, M buckets, layers, slots, rank, output folder,
    timing report."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="gpt-oss-20b", choices=sorted(models))
    ap.add_argument("--ms", default=ms_default)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default=out_default)
    ap.add_argument("--report", default=None, help="JSON file for all timings")
    return ap


def tuner_run(command: str, layers: int) -> dict:
    """Provenance of a tuner run for the config file: date, versions, layers, command."""
    import triton

    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "layers": layers, "command": command}
