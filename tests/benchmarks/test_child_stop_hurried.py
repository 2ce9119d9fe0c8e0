"""A benchmark told to stop (SIGTERM, a SIGKILL to follow) stops its children within the hurried
grace: a child that ignores its stop signal is gone in seconds, not after the 60 s + 60 s graces
it was started with, so it cannot outlive its parent on the GPU."""

from __future__ import annotations

import sys
import time

from benchmarks.stacks import process
from benchmarks.stacks.process import HURRY_GRACE_S, ChildProcess, base_env, hurry

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(600)")


def _started(tmp_path, name: str, code: str = STUBBORN, **options) -> ChildProcess:
    options = {"grace_s": 60.0, "kill_grace_s": 60.0, **options}
    child = ChildProcess(name, [sys.executable, "-c", code], base_env({}), tmp_path / f"{name}.log", **options)
    child.start()
    deadline = time.monotonic() + 60
    while "up" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "up" in child.log_path.read_text(), child.log_tail(10)
    return child


def test_a_hurried_stop_kills_a_child_that_ignores_sigterm_within_the_short_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "_hurried", False)  # restored after the test: other stops keep their graces
    child = _started(tmp_path, "stubborn")
    hurry()
    t0 = time.monotonic()
    child.stop()
    took = time.monotonic() - t0
    assert child.proc.poll() is not None
    # its stop signal ignored (one short grace), the group's SIGTERM ignored (another), then SIGKILL
    assert HURRY_GRACE_S <= took < 3 * HURRY_GRACE_S + 5, f"stop took {took:.1f} s"


def test_without_hurry_the_stop_waits_out_the_childs_own_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "_hurried", False)
    child = _started(tmp_path, "patient")
    child.grace_s, child.kill_grace_s = 2 * HURRY_GRACE_S, 1.0
    t0 = time.monotonic()
    child.stop()
    took = time.monotonic() - t0
    assert child.proc.poll() is not None
    assert took >= 2 * HURRY_GRACE_S, f"stop took {took:.1f} s: the grace was cut without hurry()"


def test_a_child_stops_on_sigint_though_its_parent_ignores_sigint(tmp_path, monkeypatch):
    """A benchmark run as a shell's background job has SIGINT ignored; the servers it starts must
    not inherit that (``serve run`` stops on SIGINT): the stop takes the child's own exit, not the
    grace and the group's SIGTERM."""
    import signal

    monkeypatch.setattr(process, "_hurried", False)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = _started(tmp_path, "polite", "import time; print('up', flush=True); time.sleep(600)",
                         stop_signal=signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    t0 = time.monotonic()
    child.stop()
    took = time.monotonic() - t0
    assert child.proc.returncode != 0 and "KeyboardInterrupt" in child.log_tail(), child.log_tail()
    assert took < 10, f"stop took {took:.1f} s: the child ignored its SIGINT"
