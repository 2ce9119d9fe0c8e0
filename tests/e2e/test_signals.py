"""``loraplex serve`` stops everything it started on SIGTERM, whatever signal dispositions it
inherited: here it runs as a background job of a non-interactive shell, which starts it with
SIGINT ignored (the case that once left ``serve run`` serving forever)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers.net import free_port
from tests.helpers.paths import REPO
from tests.helpers.stack import stack_env, stack_processes, write_config

pytestmark = pytest.mark.e2e
GRACE_S = 30  # LORAPLEX_SHUTDOWN_GRACE_S for the run: escalation must happen within it


def _sigign_of(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigIgn line")


SIGINT_BIT = 1 << (signal.SIGINT - 1)


def _background_job(command: str, env: dict, cwd) -> tuple[subprocess.Popen, int]:
    """``bash -c 'COMMAND & echo $!; wait'``: the shell and the job's pid."""
    shell = subprocess.Popen(["bash", "-c", f"{command} & echo $!; wait"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    return shell, int(shell.stdout.readline())


def test_sigterm_stops_a_background_job_and_every_process_it_started(loraplex_home, tmp_path):
    probe, probe_pid = _background_job("sleep 30", dict(os.environ), tmp_path)
    try:  # what such a job inherits: SIGINT ignored (set in the child between fork and exec)
        deadline = time.monotonic() + 5
        while not _sigign_of(probe_pid) & SIGINT_BIT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sigign_of(probe_pid) & SIGINT_BIT
    finally:
        probe.kill()
        os.kill(probe_pid, signal.SIGKILL)
    home = tmp_path / "home"
    shutil.copytree(loraplex_home, home)  # its own LORAPLEX_HOME: its processes are told apart
    port = free_port()
    config = write_config(tmp_path / "serve.yaml", port, {})
    env = stack_env(home, {"LORAPLEX_SHUTDOWN_GRACE_S": str(GRACE_S)})
    shell, pid = _background_job(
        f"{sys.executable} -m app.cli.main serve {config} > {tmp_path}/serve.log 2>&1", env, REPO)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert shell.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(2)
        started = stack_processes(home)
        assert len(started) > 5, started  # serve run, Ray's processes, the replicas
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        assert children and not any(_sigign_of(int(c)) & SIGINT_BIT for c in children), \
            "serve run must start with SIGINT's default disposition"
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S + 30
        while stack_processes(home) and time.monotonic() < deadline:
            time.sleep(1)
        left = stack_processes(home)
        assert not left, f"{len(left)} processes of the stack survived SIGTERM: {left}"
        assert shell.wait(timeout=30) == 0  # `wait` returns the job's status: a requested stop
    finally:
        for p in stack_processes(home):
            os.kill(p, signal.SIGKILL)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
