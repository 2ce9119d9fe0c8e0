"""``app.cli.serve_driver``, the child of ``loraplex serve``: an application Serve cannot build ends
the driver with Serve's own message and every process it started gone, where ``serve run`` would
have kept a Serve that serves nothing running forever."""

from __future__ import annotations

import shutil
import subprocess
import time
from types import SimpleNamespace

import pytest

from tests.helpers.net import free_port
from tests.helpers.stack import stack_env, stack_processes, write_config

pytestmark = pytest.mark.e2e


def test_failed_applications_are_those_serve_marks_deploy_failed():
    from app.cli.serve_driver import failed_applications

    status = SimpleNamespace(applications={
        "loraplex": SimpleNamespace(status="DEPLOY_FAILED", message="Deployment 'Engine' does not exist."),
        "other": SimpleNamespace(status="RUNNING", message=""),
        "starting": SimpleNamespace(status="DEPLOYING", message="")})
    assert failed_applications(status) == {"loraplex": "Deployment 'Engine' does not exist."}


def test_the_watch_outlasts_an_unreadable_status_and_ends_at_a_failed_deploy(monkeypatch, capsys):
    from ray import serve

    from app.cli.serve_driver import watch

    answers = iter([RuntimeError("controller restarting"),
                    SimpleNamespace(applications={"loraplex": SimpleNamespace(status="DEPLOYING", message="")}),
                    SimpleNamespace(applications={"loraplex": SimpleNamespace(status="DEPLOY_FAILED", message="boom")})])

    def status():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    shutdowns = []
    monkeypatch.setattr(serve, "status", status)
    monkeypatch.setattr(serve, "shutdown", lambda: shutdowns.append(1))
    assert watch(poll_s=0.0) == 1 and shutdowns == [1]
    err = capsys.readouterr().err
    assert "controller restarting" in err and "application 'loraplex' failed to deploy; Serve says:\nboom" in err


def test_an_application_serve_cannot_build_ends_the_driver_with_serves_message(loraplex_home, tmp_path):
    """Split's per-deployment override on a colocated app (what `loraplex serve` itself refuses
    up front, run here through the driver alone): Serve's controller fails the build."""
    import yaml

    from app.cli.serve_driver import command

    home = tmp_path / "home"
    shutil.copytree(loraplex_home, home)
    config = write_config(tmp_path / "serve.yaml", free_port(), {"topology": "colocated"})
    cfg = yaml.safe_load(config.read_text())
    cfg["applications"][0]["deployments"] = [{"name": "Engine", "max_surge_percent": 25}]
    config.write_text(yaml.safe_dump(cfg))
    env = stack_env(home)
    t0 = time.monotonic()
    try:
        r = subprocess.run(command(str(config)), env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr[-3000:]
        assert "application 'loraplex' failed to deploy" in r.stderr and "Engine" in r.stderr, r.stderr[-3000:]
        assert time.monotonic() - t0 < 240  # the watch ends it: no model is ever loaded
        deadline = time.monotonic() + 30
        while stack_processes(home) and time.monotonic() < deadline:
            time.sleep(1)
        assert not stack_processes(home)
    finally:
        for p in stack_processes(home):
            subprocess.run(["kill", "-9", str(p)], check=False)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


DRIVER = """
import sys, time
from types import SimpleNamespace
import ray
from ray import serve
from app.cli import serve_driver
PHASE = sys.argv[1]

def status():
    print("watching", flush=True)
    return SimpleNamespace(applications={"loraplex": SimpleNamespace(status="RUNNING", message="")})

def start(config, address):
    if PHASE == "starting":
        print("starting", flush=True)
        time.sleep(60)

serve.status = status
serve.shutdown = lambda: print("serve shut down", flush=True)
ray.is_initialized = lambda: True
serve_driver.start = start
serve_driver.POLL_S = 0.05
sys.exit(serve_driver.main(["serve.yaml"]))
"""


@pytest.mark.parametrize("phase", ["starting", "watching"])
@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_the_driver_stops_cleanly_on_a_stop_signal_even_if_it_started_with_sigint_ignored(signum, phase):
    """A shell's background job starts with SIGINT ignored, and Python then keeps it ignored:
    the driver takes SIGINT and SIGTERM as its clean stop (Serve shut down, exit 0) anyway, both
    while it starts Serve and once it watches it, however soon after either the signal comes."""
    import signal
    import sys

    from tests.helpers.paths import REPO, pythonpath_with_repo

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, phase], cwd=REPO, env={"PYTHONPATH": pythonpath_with_repo()},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore_sigint)
    try:
        assert proc.stdout.readline().strip() == phase
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, signum))
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    said = {"starting": "stopped while starting: shutting Serve down", "watching": "stopping: shutting Serve down"}
    assert said[phase] in out and "serve shut down" in out, out
    assert time.monotonic() - t0 < 10  # the signal stops it, not the 60 s start nor a later poll
