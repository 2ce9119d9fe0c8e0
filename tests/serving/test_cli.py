"""The ``loraplex`` CLI: init is idempotent and deterministic, tenants add prints the key last."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from app.gateway.tenants import TenantDirectory


def run_cli(home, *args):
    env = {"LORAPLEX_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "app.cli.main", *args], env=env, capture_output=True, text=True, check=True)


def digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_init_builds_the_embedded_default_deterministically(loraplex_home, tmp_path):
    from app.embedded.setup import DEMO_ADAPTERS, model_dir

    assert (model_dir(loraplex_home) / "config.json").exists()
    assert (model_dir(loraplex_home) / "tokenizer.json").exists()
    ids = {p.name for p in (loraplex_home / "store").iterdir()}
    assert {s.adapter_id for s in DEMO_ADAPTERS} <= ids
    assert any(s.kind == "experts" for s in DEMO_ADAPTERS) and any(s.kind == "attention" for s in DEMO_ADAPTERS)
    other = tmp_path / "home2"
    run_cli(other, "init")
    assert digest(model_dir(other)) == digest(model_dir(loraplex_home))  # same seed, same bytes
    before = digest(other / "store")
    out = run_cli(other, "init")  # idempotent: nothing rebuilt or republished
    assert digest(other / "store") == before and "ready" in out.stdout


def test_tenants_add_prints_the_key_alone_on_its_last_line(tmp_path):
    out = run_cli(tmp_path, "tenants", "add", "newco")
    key = out.stdout.strip().splitlines()[-1]
    assert " " not in key and key.startswith("lpx-")
    assert TenantDirectory(tmp_path / "tenants.yaml").authenticate(f"Bearer {key}").name == "newco"
    listed = run_cli(tmp_path, "tenants", "list").stdout
    assert "newco" in listed and key not in listed


def test_bench_lists_available_benchmarks(tmp_path):
    r = subprocess.run([sys.executable, "-m", "app.cli.main", "bench", "no-such-bench"], capture_output=True, text=True)
    assert r.returncode == 2 and "serving" in r.stderr


def test_serve_cleanup_removes_only_orphaned_new_shm_segments():
    import mmap
    import multiprocessing
    import uuid
    from pathlib import Path

    from app.cli import serve_cmd

    shm = Path("/dev/shm")
    assert shm.is_dir(), "Linux's /dev/shm is where vLLM's engine leaves segments"
    tag = uuid.uuid4().hex
    old = shm / f"lpx-test-old-{tag}"
    old.write_bytes(b"x")
    before = set(shm.iterdir())
    orphan, held = shm / f"lpx-test-orphan-{tag}", shm / f"lpx-test-held-{tag}"
    orphan.write_bytes(b"x")
    held.write_bytes(b"x")
    mapped = shm / f"lpx-test-mapped-{tag}"
    mapped.write_bytes(b"x" * 4096)
    # a POSIX semaphore another program made meanwhile: glibc maps it under a temporary name
    semaphore = multiprocessing.get_context("spawn").Lock()
    sem_files = {p for p in set(shm.iterdir()) - before if p.name.startswith("sem.")}
    assert sem_files, "the semaphore has a name under /dev/shm"
    try:
        with open(mapped, "r+b") as f:
            view = mmap.mmap(f.fileno(), 4096)  # mapped, its fd closed
        try:
            with open(held, "rb"):  # open
                serve_cmd.remove_new_shm(before)
        finally:
            view.close()
        assert not orphan.exists() and old.exists()
        assert (held.exists(), mapped.exists(), all(p.exists() for p in sem_files)) == (True, True, True), \
            "segments in use (open, mapped, a semaphore) must survive"
    finally:
        del semaphore
        for p in (old, orphan, held, mapped):
            p.unlink(missing_ok=True)


def test_serve_refuses_a_config_serve_would_take_and_never_serve_before_starting_anything(tmp_path):
    """deploy/h200.yaml switched to the colocated topology with split's per-deployment overrides
    (Serve's controller rejects such an app after `serve run` started, and `serve run` then
    serves nothing, forever), and an unknown engine key: exit 2 at once, each problem named,
    no Ray started and no LORAPLEX_HOME initialised."""
    import time

    import yaml

    from tests.helpers.paths import REPO

    cfg = yaml.safe_load((REPO / "deploy" / "h200.yaml").read_text())
    app = cfg["applications"][0]
    app["args"]["topology"] = "colocated"
    app["deployments"] = [{"name": "Engine", "max_surge_percent": 25}, {"name": "Gateway"}, {"name": "Server"}]
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump(cfg))
    home = tmp_path / "home"
    env = {"LORAPLEX_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "app.cli.main", "serve", str(path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "overrides for 'Engine', 'Gateway', which topology 'colocated' does not deploy (it deploys 'Server')" in r.stderr
    assert "args.engine_deployment" in r.stderr and not home.exists() and time.monotonic() - t0 < 60
    app["args"]["topology"] = "split"
    app["deployments"] = [{"name": "Engine", "max_surge_percent": 25}]  # split has an Engine: accepted
    app["args"]["engine"]["max_lora"] = 8  # typo of max_loras: AppConfig forbids unknown keys
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "app.cli.main", "serve", str(path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "args.engine.max_lora: Extra inputs are not permitted" in r.stderr, r.stderr
    assert "deployments:" not in r.stderr and not home.exists()
