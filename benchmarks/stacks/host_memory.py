"""One line on this host's memory, for a server's start log: what the kernel and the container's
cgroup count as used (Ray's memory monitor kills workers on the cgroup's figure less its inactive
file pages, so freshly written files count), and the processes holding the most resident memory.

Linux only; every figure that cannot be read is left out of the line.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
GIB = 2**30


def available_bytes() -> int | None:
    """``MemAvailable``: memory the host can give without swapping (None where unknown)."""
    return _meminfo().get("MemAvailable")


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes; empty where it cannot be read."""
    try:
        lines = (PROC / "meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup() -> dict[str, int]:
    """cgroup v2's ``memory.current``, ``memory.max`` (absent when unlimited) and the file and
    anonymous counts of ``memory.stat``, in bytes; empty outside cgroup v2."""
    out: dict[str, int] = {}
    for name in ("memory.current", "memory.max"):
        try:
            text = (CGROUP / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            out[name] = int(text)
    try:
        for line in (CGROUP / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("anon", "file", "active_file", "inactive_file", "shmem") and value.isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _largest_processes(n: int) -> list[tuple[int, int, str]]:
    """``(rss bytes, pid, short name)`` of the ``n`` processes with the most resident memory."""
    procs = []
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            rss = int((d / "statm").read_text().split()[1]) * 4096
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        procs.append((rss, int(d.name), " ".join(cmd.split())[:60] or d.name))
    return sorted(procs, reverse=True)[:n]


def memory_line(top: int = 5) -> str:
    """``host memory: used U of T GiB (available A); cgroup C of M GiB (anon, file active/inactive);
    largest: <rss> <pid> <command>, ...``."""
    parts = []
    if (m := _meminfo()) and "MemTotal" in m and "MemAvailable" in m:
        parts.append(f"used {(m['MemTotal'] - m['MemAvailable']) / GIB:.1f} of {m['MemTotal'] / GIB:.1f} GiB "
                     f"(available {m['MemAvailable'] / GIB:.1f})")
    if (c := _cgroup()) and "memory.current" in c:
        limit = f" of {c['memory.max'] / GIB:.1f}" if "memory.max" in c else ""
        detail = ", ".join(f"{k} {c[k] / GIB:.1f}" for k in ("anon", "active_file", "inactive_file", "shmem") if k in c)
        parts.append(f"cgroup {c['memory.current'] / GIB:.1f}{limit} GiB ({detail})")
    largest = ", ".join(f"{rss / GIB:.1f} GiB {pid} {cmd!r}" for rss, pid, cmd in _largest_processes(top))
    return "host memory: " + "; ".join(parts) + (f"; largest: {largest}" if largest else "")
