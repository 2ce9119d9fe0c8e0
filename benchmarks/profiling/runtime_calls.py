"""The host's CUDA runtime and driver API calls over ``torch.profiler`` events recorded with CPU
activity: launches, copies, synchronisations and allocations per step, and which of them may
wait for the GPU."""

from __future__ import annotations

from collections import defaultdict

SYNCING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                 "cudaMemcpy", "cudaMemset", "cudaHostAlloc", "cudaMallocHost", "cudaMalloc",
                 "cudaFree", "cudaFreeHost", "cudaHostRegister")


def runtime_calls(events) -> dict[str, tuple[float, int]]:
    """Host milliseconds and calls per CUDA runtime / driver API function (``cuda*``, ``cu*``:
    launches, copies, synchronisations, allocations) over ``torch.profiler`` events recorded
    with CPU activity: where the host waits for the GPU or the driver."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        name = ev.name
        if str(getattr(ev, "device_type", "")).endswith("CPU") and name.startswith("cu"):
            out[name][0] += (ev.cpu_time_total or 0.0) / 1e3
            out[name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def print_runtime_table(title: str, steps: int, columns: dict[str, dict]) -> None:
    """Per-step host ms and calls of each CUDA API function in each column; functions that
    wait for the GPU or allocate (``SYNCING_CALLS``) marked."""
    labels = list(columns)
    names = sorted(set().union(*columns.values()),
                   key=lambda n: -max(c.get(n, (0.0, 0))[0] for c in columns.values()))
    print(f"\n{title}: CUDA API calls on the host, ms / calls per step ({steps} steps; * may "
          "wait for the GPU or allocate)")
    print("| call | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for n in names:
        mark = " *" if n.startswith(SYNCING_CALLS) else ""
        cells = [f"{c.get(n, (0.0, 0))[0] / steps:.3f} / {c.get(n, (0.0, 0))[1] / steps:.1f}"
                 for c in columns.values()]
        print(f"| `{n}`{mark} | " + " | ".join(cells) + " |")
