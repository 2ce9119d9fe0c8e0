"""What every launcher shares: the server's child process, readiness, and stopping everything.

``ChildProcess`` starts one command in its own process group (``start_new_session``) on a log
file, at the normal scheduling policy whatever the parent's (a load generator may run real-time),
with a marker in its environment (``LPX_STACK_ID``) that every process it starts inherits, so the
stop can find them even where they moved to another process group (``loraplex serve`` starts
``serve run`` in a session of its own; Ray's workers are children of the raylet).

Stop: the leader gets the launcher's stop signal (it stops what it started: ``serve run`` takes
SIGINT, SIGTERM aborts it; vLLM's server and ``loraplex serve`` take SIGTERM), its group SIGTERM
after ``grace_s``, SIGKILL ``kill_grace_s`` later; then any process still carrying the marker gets
SIGTERM and SIGKILL the same way. ``stop`` raises when a process survives that, and records which
processes outlived their leader (``stragglers``). After ``hurry()`` (the benchmark itself was told
to stop, and whoever told it will SIGKILL it soon) every grace is at most ``HURRY_GRACE_S``, so
the children are gone before their parent is, instead of outliving it on the GPU.

``Server`` is the launcher's frame: subclasses say what to run (``prepare``) and how to address it
(``target``); ``start`` runs it and waits until a real one-token completion of the base model
succeeds (listing models answers before the engine is up), then one per adapter, so a server
that cannot apply LoRA fails at start with its answer and the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.cli.serve_cmd import SHM, remove_new_shm
from app.cli.serve_driver import default_stop_signals
from benchmarks.loadgen.spec import TargetSpec
from benchmarks.stacks.host_memory import memory_line
from tests.helpers.net import free_port
from tests.helpers.paths import REPO
from tests.helpers.stack import stack_env

HURRY_GRACE_S = 5.0
_hurried = False


def hurry() -> None:
    """From now on, stops wait at most ``HURRY_GRACE_S`` per step."""
    global _hurried
    _hurried = True


def _grace(seconds: float) -> float:
    return min(seconds, HURRY_GRACE_S) if _hurried else seconds

MARKER_ENV = "LPX_STACK_ID"
READY_TIMEOUT_S = 900.0
MEMORY_LOG_S = 20.0  # a line on the host's memory this often while a server starts
PROBE_PROMPT = "hello"


def _normal_scheduling() -> None:
    """In the child before ``exec``: the default policy (a real-time parent's is inherited) and
    the default dispositions of the stop signals (a parent started as a shell's background job
    has SIGINT ignored, and ``serve run`` would then ignore the SIGINT that stops it)."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    default_stop_signals()


def cmdline(pid: int | str) -> str:
    """The command line of ``pid`` (arguments joined by spaces); empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``LPX_STACK_ID=marker`` (zombies excluded)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (needle in (proc / "environ").read_bytes().split(b"\0")
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                pids.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return pids


def _signal_pids(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _wait_gone(pids_of, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class ChildProcess:
    """One command in its own process group, its output in ``log_path`` (module doc)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, *,
                 cwd: Path = REPO, stop_signal: int = signal.SIGTERM, grace_s: float = 60.0,
                 kill_grace_s: float = 10.0) -> None:
        self.name, self.cmd, self.log_path, self.cwd = name, cmd, log_path, cwd
        self.stop_signal, self.grace_s, self.kill_grace_s = stop_signal, grace_s, kill_grace_s
        self.marker = uuid.uuid4().hex
        self.env = dict(env, **{MARKER_ENV: self.marker})
        self.proc: subprocess.Popen | None = None
        self.stragglers: list[int] = []

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_normal_scheduling)  # noqa: PLW1509 - launchers start no threads
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process this child started (the leader included while it runs)."""
        return marked_pids(self.marker)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _killpg(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """Stop signal to the leader, then SIGTERM/SIGKILL to its group, then to every marked
        process; raises RuntimeError when one survives SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(_grace(self.grace_s))
            except subprocess.TimeoutExpired:
                self._killpg(signal.SIGTERM)
                try:
                    self.proc.wait(_grace(self.kill_grace_s))
                except subprocess.TimeoutExpired:
                    self._killpg(signal.SIGKILL)
                    self.proc.wait()
        # the leader is gone: what is left of its group or carries its marker is stopped too
        left = _wait_gone(self.pids, 5.0)
        self.stragglers = list(left)
        if left:
            self._killpg(signal.SIGTERM)
            _signal_pids(left, signal.SIGTERM)
            left = _wait_gone(self.pids, _grace(self.kill_grace_s))
        if left:
            self._killpg(signal.SIGKILL)
            _signal_pids(left, signal.SIGKILL)
            left = _wait_gone(self.pids, 5.0)
        if left:
            raise RuntimeError(f"{self.name}: processes {left} survived SIGKILL")


@dataclass
class Launch:
    """What a launcher runs: the command, its environment, how it is stopped, and what is removed
    after it: ``ray_tmp``, the Ray temp dir of the server's own cluster, once its logs (Serve's
    controller and replicas, the raylet, workers' stderr) are kept in the work folder;
    ``clean_shm``: the ``/dev/shm`` segments it left orphaned, which vLLM inside a Ray replica
    does."""

    cmd: list[str]
    env: dict[str, str]
    stop_signal: int = signal.SIGTERM
    grace_s: float = 60.0
    clean_shm: bool = False
    cwd: Path = REPO  # another checkout's code runs from there (``LoraplexServer(checkout=...)``)
    ray_tmp: Path | None = None


RAY_LOG_FILE_LIMIT = 32 << 20  # a larger log keeps its last RAY_LOG_FILE_LIMIT bytes


def keep_ray_logs(ray_tmp: Path, dest: Path, limit: int = RAY_LOG_FILE_LIMIT) -> list[Path]:
    """Copies ``ray_tmp/ray/session_*/logs/`` (``ray_tmp`` is the cluster's ``$RAY_TMPDIR``; what a
    replica death, an OOM kill or a slow start leaves there) to ``dest/session_*/``, each file cut
    to its last ``limit`` bytes; returns the files."""
    kept = []
    for logs in sorted(ray_tmp.glob("ray/session_2*/logs")):
        for src in sorted(p for p in logs.rglob("*") if p.is_file()):
            out = dest / logs.parent.name / src.relative_to(logs)
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as f:
                f.seek(max(0, src.stat().st_size - limit))
                out.write_bytes(f.read())
            kept.append(out)
    return kept


def _checkout_env(env: dict[str, str]) -> dict[str, str]:
    """Offline, vLLM-CPU's KV cache at 1 GiB unless set, the checkout importable (Serve's import
    paths, the benchmark's vLLM plugin)."""
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that runs vLLM."""
    return _checkout_env(dict(os.environ, **(extra or {})))


def ray_env(home: Path, extra: dict[str, str] | None = None) -> tuple[dict[str, str], Path]:
    """The environment of a ``serve run`` of its own (``tests.helpers.stack.stack_env``: loopback,
    no usage stats, a Ray temp dir of its own; ``LORAPLEX_HOME=home``) for a child that runs vLLM;
    returns it and the Ray temp dir."""
    env = _checkout_env(stack_env(home, extra))
    return env, Path(env["RAY_TMPDIR"])


def serve_run_cmd(config: Path) -> list[str]:
    """``serve run`` of a Serve config on a new local Ray cluster (never an address left over)."""
    return [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", "--address", "local", str(config)]


class ServerNotReady(RuntimeError):
    """The server exited, answered an error or did not answer in time; carries the log's tail."""


def probe_completion(target: TargetSpec, adapter: str | None, timeout_s: float = 120.0) -> httpx.Response:
    """One greedy one-token ``/v1/completions`` for an adapter id (None: the base model)."""
    key = target.key_for(adapter, 0)
    return httpx.post(target.base_url + "/v1/completions", timeout=timeout_s,
                      headers={"Authorization": f"Bearer {key}"} if key else {},
                      json={"model": target.model_name(adapter), "prompt": PROBE_PROMPT, "max_tokens": 1,
                            "temperature": 0})


def _completed(r: httpx.Response) -> bool:
    try:
        return r.status_code == 200 and bool(r.json().get("choices"))
    except ValueError:
        return False


@contextlib.contextmanager
def _memory_log(name: str, t0: float, every_s: float = MEMORY_LOG_S):
    """While the block runs, a line on the host's memory every ``every_s`` seconds (a thread:
    the readiness probes block for up to a minute each)."""
    done = threading.Event()

    def log() -> None:
        while not done.wait(every_s):
            print(f"{name}: not ready after {time.monotonic() - t0:.0f} s; {memory_line()}", flush=True)

    thread = threading.Thread(target=log, name=f"{name}-memory-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class Server:
    """One server under test as a context manager: ``with Launcher(...) as target``. Subclasses
    set ``kind`` and implement ``prepare`` (write configs, return the ``Launch``) and ``target``;
    ``adapters`` are the adapter ids probed at start."""

    kind = "server"

    def __init__(self, workdir: Path, name: str | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name or self.kind
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        self.log_path = self.workdir / f"{self.name}.log"
        self.child: ChildProcess | None = None
        self.ready_s: float | None = None
        self.adapters: list[str] = []
        self._launch: Launch | None = None
        self._shm_before: set[Path] | None = None

    # ---- what subclasses provide ----
    def prepare(self) -> Launch:
        raise NotImplementedError

    def target(self) -> TargetSpec:
        raise NotImplementedError

    def release(self) -> None:
        """Anything else the launcher started (a local S3 server); after the child is stopped."""

    # ---- lifecycle ----
    def start(self) -> TargetSpec:
        t0 = time.monotonic()
        try:
            launch = self._launch = self.prepare()
            if launch.clean_shm and SHM.is_dir():
                self._shm_before = set(SHM.iterdir())
            self.child = ChildProcess(self.name, launch.cmd, launch.env, self.log_path, cwd=launch.cwd,
                                      stop_signal=launch.stop_signal, grace_s=launch.grace_s).start()
            target = self.target()
            with _memory_log(self.name, t0):  # what a start that dies midway had around it
                self._wait_ready(target, t0)
            for adapter in self.adapters:
                r = probe_completion(target, adapter)
                if not _completed(r):
                    raise ServerNotReady(f"{self.name}: a one-token completion of adapter {adapter!r} "
                                         f"({target.model_name(adapter)}) answered {r.status_code}: "
                                         f"{r.text[:2000]}\n--- {self.log_path} (tail) ---\n{self.child.log_tail()}")
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return target

    def _wait_ready(self, target: TargetSpec, t0: float) -> None:
        last = "no answer"
        while time.monotonic() - t0 < self.ready_timeout_s:
            if not self.child.alive():
                raise ServerNotReady(f"{self.name} exited with {self.child.proc.returncode} before it was ready:\n"
                                     f"--- {self.log_path} (tail) ---\n{self.child.log_tail()}")
            try:
                r = probe_completion(target, None, timeout_s=60)
                if _completed(r):
                    return
                last = f"{r.status_code}: {r.text[:500]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(1.0)
        raise ServerNotReady(f"{self.name} not ready after {self.ready_timeout_s:.0f}s (last: {last}):\n"
                             f"--- {self.log_path} (tail) ---\n{self.child.log_tail()}")

    def pids(self) -> list[int]:
        return self.child.pids() if self.child else []

    def stop(self) -> None:
        try:
            if self.child is not None:
                self.child.stop()
        finally:
            try:
                self.release()
            finally:
                if self._shm_before is not None:
                    remove_new_shm(self._shm_before)
                if self._launch is not None and self._launch.ray_tmp is not None:
                    with contextlib.suppress(OSError):
                        keep_ray_logs(self._launch.ray_tmp, self.workdir / f"{self.name}-ray-logs")
                    shutil.rmtree(self._launch.ray_tmp, ignore_errors=True)

    def __enter__(self) -> TargetSpec:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
