"""``app.cli.free_ports``: ports a later bind can count on."""

from __future__ import annotations

import socket

import pytest

from app.cli import free_ports as fp


def test_picks_are_distinct_free_and_outside_the_ranges_ray_and_the_kernel_draw_from():
    """The CI failure this guards: HAProxy's metrics port, picked by ``bind(0)``, was taken by a
    Ray process during Ray's start ("cannot bind socket (Address already in use)")."""
    window = fp.pick_window()
    ports = fp.free_ports(16)
    assert len(set(ports)) == 16
    with socket.socket() as s:
        s.bind(("", 0))
        kernel_pick = s.getsockname()[1]
    assert kernel_pick not in window
    for port in ports:
        assert window.start > fp.RAY_WORKER_PORTS_END and port in window
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        busy = held.getsockname()[1]
        monkeypatch.setattr(fp, "MIN_WINDOW", 1)
        monkeypatch.setattr(fp, "pick_window", lambda: range(busy, busy + 1))
        with pytest.raises(OSError, match=f"fewer than 1 free TCP ports between {busy} and {busy}"):
            fp.free_ports(1)
    assert fp.free_ports(1) == [busy]


def test_too_small_a_window_falls_back_to_the_kernels_picks(monkeypatch, tmp_path):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{fp.RAY_WORKER_PORTS_END + 10}\t60999\n")
    monkeypatch.setattr(fp, "EPHEMERAL_RANGE_FILE", narrow)
    assert len(fp.pick_window()) < fp.MIN_WINDOW
    ports = fp.free_ports(3)
    assert len(set(ports)) == 3 and all(p > fp.RAY_WORKER_PORTS_END + 9 for p in ports)
