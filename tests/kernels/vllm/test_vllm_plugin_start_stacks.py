"""``kernels.vllm.plugin.stack_dumps_from_env``: every thread's stack on stderr at the interval of
``LORAPLEX_START_STACKS_S``, for ``LORAPLEX_START_STACKS_UNTIL_S`` seconds or until stopped (each
case in a process of its own: faulthandler's dump timer is per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import sys, time
from kernels.vllm import plugin
every = plugin.stack_dumps_from_env()
print("interval", every, flush=True)
def waiting_here():
    time.sleep(float(sys.argv[1]))
waiting_here()
if len(sys.argv) > 2:
    plugin.stop_stack_dumps()
    time.sleep(float(sys.argv[2]))
"""


def _child(env: dict[str, str], *args: float) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_START_STACKS")} | env
    return subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], env=full, capture_output=True, text=True,
                          timeout=60)


def _dumps(stderr: str) -> int:
    return stderr.count("Timeout (")  # faulthandler's header of each dump


def test_stacks_are_dumped_at_the_interval_and_stop_at_the_deadline():
    out = _child({"LORAPLEX_START_STACKS_S": "0.2", "LORAPLEX_START_STACKS_UNTIL_S": "0.6"}, 3.0)
    assert out.returncode == 0, out.stderr
    assert "interval 0.2" in out.stdout
    assert "waiting_here" in out.stderr  # the main thread's frame, where it waits
    assert 1 <= _dumps(out.stderr) <= 8, out.stderr[-2000:]  # ~3 before the deadline; 15 without it


def test_stop_ends_the_dumps():
    out = _child({"LORAPLEX_START_STACKS_S": "0.2"}, 0.5, 2.5)
    assert out.returncode == 0, out.stderr
    assert 1 <= _dumps(out.stderr) <= 8, out.stderr[-2000:]  # ~2 before the stop; 15 without it


def test_off_without_the_variable():
    out = _child({}, 0.5)
    assert out.returncode == 0 and "interval None" in out.stdout and _dumps(out.stderr) == 0, out.stderr


@pytest.mark.parametrize("every,until", [("x", "1"), ("0", "1"), ("1", "-2")])
def test_a_bad_setting_says_what_to_fix(every, until):
    out = _child({"LORAPLEX_START_STACKS_S": every, "LORAPLEX_START_STACKS_UNTIL_S": until}, 0)
    assert out.returncode != 0 and "LORAPLEX_START_STACKS_S" in out.stderr, out.stderr
