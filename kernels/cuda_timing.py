"""CUDA-graph timing shared by the kernel benchmark and the tuner."""

from __future__ import annotations

import statistics

import torch


def log(*a) -> None:
    print(*a, flush=True)


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
