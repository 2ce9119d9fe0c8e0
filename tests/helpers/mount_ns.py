"""Real file-system faults without root on the host: a child process in its own user and mount
namespace (``unshare -Urm``), where it may mount a size-bounded tmpfs and remount it read-only;
nothing of it is visible outside, and it disappears with the child."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO, pythonpath_with_repo


def run_python_in_mount_namespace(module: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m module args...`` inside ``unshare -Urm``, with the checkout importable."""
    env = dict(os.environ, PYTHONPATH=pythonpath_with_repo())
    return subprocess.run(["unshare", "-Urm", sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def mount_tmpfs(path: Path, size_bytes: int) -> None:
    """Inside the namespace: a tmpfs of ``size_bytes`` (whole pages) at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True)


def remount(path: Path, options: str) -> None:
    """Inside the namespace: new mount options (``ro``, ``rw``, ``size=…``)."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)
