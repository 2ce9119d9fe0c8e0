"""``loraplex serve [CONFIG]``: init if needed, then ``serve run CONFIG`` (``app.cli.serve_driver``:
its start, plus an end when an application fails to deploy) until Ctrl-C or SIGTERM.

The driver, like ``serve run``, takes SIGINT as its clean stop, so SIGTERM (and SIGINT) are
forwarded to it as SIGINT, which stops Serve and the local Ray cluster it started. Whatever dispositions this process inherited
(a shell's background job starts with SIGINT ignored), the handlers are in place before the child
starts and the child starts with default ones. If the child has not stopped ``SHUTDOWN_GRACE_S``
after the first signal, its process group gets SIGTERM, and ``KILL_GRACE_S`` later SIGKILL; once
it has exited, anything left in its group is stopped the same way. Exit status: 0 after a
requested stop, otherwise the child's (1 if it exited 0 on its own, or an application failed to
deploy); 2 before
anything starts when the config is missing or fails ``app.cli.serve_config_check``. Shared-memory
segments the run left orphaned in ``/dev/shm`` (new since the start, and held by no process) are
removed afterwards. Once the app answers ``/readyz``, the demo keys and how to call the API are
printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from app.cli import serve_driver
from app.cli.serve_config_check import config_problems, largest_header_bytes
from app.cli.serve_env import PROXIES, Proxy, serve_env

DEFAULT_CONFIG = "deploy/config.yaml"
SHUTDOWN_GRACE_S = float(os.environ.get("LORAPLEX_SHUTDOWN_GRACE_S", "60"))
KILL_GRACE_S = 10.0
SHM = Path("/dev/shm")


def http_address(config_path: Path) -> tuple[str, int]:
    """``(host, port)`` of the Serve HTTP proxy from the config (Serve defaults otherwise)."""
    cfg = yaml.safe_load(config_path.read_text()) or {}
    http = cfg.get("http_options") or {}
    return str(http.get("host", "127.0.0.1")), int(http.get("port", 8000))


def usage_text(base_url: str, keys: dict[str, str], base_model: str = "loraplex-base") -> str:
    key = keys.get("acme", "<your key>")
    lines = ["", "loraplex is ready at " + base_url]
    lines += [f"  demo key for tenant {name}: {k}" for name, k in keys.items()]
    lines += [
        "",
        "  curl:",
        f"    curl {base_url}/v1/adapters/acme-support/chat/completions \\",
        f"      -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
        "      -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 16}'",
        "",
        "  OpenAI SDK:",
        "    from openai import OpenAI",
        f"    client = OpenAI(base_url='{base_url}/v1', api_key='{key}')",
        "    client.chat.completions.create(model='acme-support',",
        "        messages=[{'role': 'user', 'content': 'hello'}], max_tokens=16)",
        f"  (model='{base_model}' calls the base model; GET /v1/models lists what a key may call)",
        "",
    ]
    return "\n".join(lines)


def _announce_when_ready(base_url: str, stop: threading.Event) -> None:
    from app.embedded.setup import demo_keys

    while not stop.wait(2.0):
        try:
            if httpx.get(base_url + "/readyz", timeout=30).status_code == 200:
                print(usage_text(base_url, demo_keys()), flush=True)
                return
        except httpx.HTTPError:
            pass


class Supervisor:
    """Runs the driver in its own process group and stops the group on request (module doc)."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.stop_requested_at: float | None = None
        for signum in serve_driver.STOP_SIGNALS:  # before the child exists: no window without a handler
            signal.signal(signum, self.request_stop)
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                     preexec_fn=serve_driver.default_stop_signals)

    def request_stop(self, signum=None, frame=None) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the driver's (serve run's) clean shutdown

    def wait(self) -> int:
        """Until the child exits (escalating after a stop request), then until its group is
        gone; returns the exit status of ``loraplex serve``."""
        escalated = 0
        while self.proc.poll() is None:
            if self.stop_requested_at is not None:
                late = time.monotonic() - self.stop_requested_at
                if escalated == 0 and late > SHUTDOWN_GRACE_S:
                    escalated = self._signal_group(signal.SIGTERM) or 1
                elif escalated == 1 and late > SHUTDOWN_GRACE_S + KILL_GRACE_S:
                    escalated = self._signal_group(signal.SIGKILL) or 2
            time.sleep(0.2)
        self._stop_leftovers()
        if self.stop_requested_at is not None:
            return 0
        return self.proc.returncode or 1

    def _signal_group(self, signum: int) -> int:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass
        return 1 if signum == signal.SIGTERM else 2

    def _stop_leftovers(self) -> None:
        """Processes left in the child's group (Ray's, vLLM's): SIGTERM, then SIGKILL."""
        for signum, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


def run(config: str, proxy: Proxy = "haproxy") -> int:
    from app.embedded.setup import init, is_initialized

    config_path = Path(config)
    if not config_path.exists():
        print(f"config file not found: {config}", file=sys.stderr)
        return 2
    try:
        cfg = yaml.safe_load(config_path.read_text()) or {}
        problems = config_problems(cfg)
    except yaml.YAMLError as exc:
        problems = [f"not YAML: {exc}"]
    if problems:
        print(f"{config}: not a config loraplex can serve:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    if not is_initialized():
        init()
    env, run_dir = serve_env(dict(os.environ), proxy, largest_header_bytes(cfg))
    shm_before = set(SHM.iterdir()) if SHM.is_dir() else set()
    supervisor = Supervisor(serve_driver.command(str(config_path)), env)
    host, port = http_address(config_path)
    stop = threading.Event()
    threading.Thread(target=_announce_when_ready, args=(f"http://{host}:{port}", stop), daemon=True).start()
    try:
        return supervisor.wait()
    finally:
        stop.set()
        remove_new_shm(shm_before)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def remove_new_shm(before: set[Path]) -> None:
    """Removes shared-memory segments that appeared during the run and that no process still
    holds open or mapped (orphans of the stopped vLLM/Ray processes); others' are left alone."""
    if not SHM.is_dir():
        return
    held = _shm_inodes_in_use()
    for path in set(SHM.iterdir()) - before:
        try:
            st = path.stat()
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_ino not in held:
                path.unlink()
        except OSError:
            pass


def _shm_inodes_in_use() -> set[int]:
    """Inodes of ``/dev/shm`` files that some process has open (fd) or mapped. By inode, not by
    name: a POSIX semaphore is mapped under the temporary name glibc created it with."""
    shm_dev = SHM.stat().st_dev
    used: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            fds = []
        for fd in fds:
            try:  # an fd closed since the listing must not hide the process's others, nor its maps
                st = fd.stat()
            except OSError:
                continue
            if st.st_dev == shm_dev:
                used.add(st.st_ino)
        try:
            maps = (proc / "maps").read_text().splitlines()
        except OSError:
            continue
        for line in maps:  # address perms offset dev inode [path]
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                used.add(int(fields[4]))
    return used


def add_subparser(sub) -> None:
    p = sub.add_parser("serve", help="init if needed, then `serve run CONFIG` (Ctrl-C stops everything)")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"Serve config (default {DEFAULT_CONFIG})")
    p.add_argument("--proxy", choices=PROXIES, default="haproxy",
                   help="Serve's data path: HAProxy + direct gRPC (default) or the Python proxy")
    p.set_defaults(func=lambda args: run(args.config, args.proxy))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex serve")
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    parser.add_argument("--proxy", choices=PROXIES, default="haproxy")
    args = parser.parse_args(argv)
    return run(args.config, args.proxy)
