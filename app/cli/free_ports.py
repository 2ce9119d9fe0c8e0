"""TCP ports for a process that binds them later: free now and outside the ranges others draw from.

A port from ``bind(0)`` comes from the kernel's ephemeral range, the range every outgoing
connection and every other ``bind(0)`` also draws from; Ray picks its own random ports from there
up to 65535 and ``ray start`` gives its workers 10002–19999. Between the pick and the bind (a Ray
start: seconds, dozens of processes) such a port can be taken. Ports here are drawn at random from
between Ray's worker range and the ephemeral range, where nothing picks ports by itself; each is
checked free on every interface at the time of the pick.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999
"""The last port of ``ray start``'s default worker range; picks start above it."""
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32768
"""The start of the ephemeral range where the kernel does not say (Linux's default, and IANA's
dynamic range starts above it)."""
MIN_WINDOW = 1024
"""Fewest ports the window must hold; below that picks fall back to the kernel's."""


def pick_window() -> range:
    """The ports picks are drawn from: above Ray's worker ports, below the ephemeral range."""
    try:
        start = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = DEFAULT_EPHEMERAL_START
    return range(RAY_WORKER_PORTS_END + 1, start)


def is_free(port: int) -> bool:
    """Whether ``port`` can be bound on every interface now."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on this machine now, from :func:`pick_window` (random order,
    so two pickers rarely meet); the kernel's own picks when the window is too small."""
    window = pick_window()
    if len(window) < MIN_WINDOW:
        return _kernel_ports(n)
    picked: list[int] = []
    for port in random.sample(window, len(window)):
        if is_free(port):
            picked.append(port)
            if len(picked) == n:
                return picked
    raise OSError(f"fewer than {n} free TCP ports between {window.start} and {window.stop - 1}")


def _kernel_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
