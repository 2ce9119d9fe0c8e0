"""A Ray worker node lost under the stack: two Ray nodes on this machine
(``tests.helpers.two_nodes``), the gateway on the head, one engine replica per node
(``max_replicas_per_node: 1``), the embedded default's adapters from its local store. The
worker node vanishes (raylet, Ray workers and engine processes SIGKILLed together): the
replica on the head keeps serving, with at most 503 + Retry-After while the router learns;
once a new node joins, Serve places the lost replica there and the invariants hold.

``serve run --address <cluster>`` deploys onto the running cluster, as on a real one; Serve's
Python proxy on the head only (``proxy_location: HeadOnly``: one machine, one HTTP port).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.helpers.completions import complete
from tests.helpers.net import free_port
from tests.helpers.paths import REPO, pythonpath_with_repo
from tests.helpers.two_nodes import HEAD_RESOURCE, TwoNodeCluster

pytestmark = pytest.mark.e2e
ADAPTER = "acme-support"


def _until(condition, timeout_s: float, what: str, period_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(period_s)
    return got


@pytest.fixture
def two_node_stack(loraplex_home, tmp_path):
    """The stack on a two-node cluster: ``(stack, cluster)``; everything stopped afterwards."""
    from app.cli.serve_driver import command
    from app.embedded.setup import demo_keys
    from tests.helpers.stack import Stack, stack_env, stack_processes, wait_for_engine_replicas, write_config

    home = tmp_path / "home"  # its own LORAPLEX_HOME: marks this stack's processes apart from the session's
    shutil.copytree(loraplex_home, home, ignore=shutil.ignore_patterns("cache"))
    env = stack_env(home, {"PYTHONPATH": pythonpath_with_repo(), "RAY_AUTH_MODE": "token"})
    port = free_port()
    config = write_config(tmp_path / "serve-config.yaml", port, {
        "topology": "split",
        "engine_deployment": {"num_replicas": 2, "max_replicas_per_node": 1},
        "gateway_deployment": {"ray_actor_options": {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}}},
    })
    log_path = tmp_path / "serve-run.log"
    with TwoNodeCluster(env) as cluster, open(log_path, "wb") as log:
        proc = subprocess.Popen(command(str(config), cluster.address),
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack = Stack(f"http://127.0.0.1:{port}", home, demo_keys(home), proc, log_path, env,
                      store_uri=(home / "store").as_uri())
        try:
            def ready():
                assert proc.poll() is None, f"serve run exited with {proc.returncode}:\n{stack.log_tail()}"
                try:
                    return httpx.get(stack.base_url + "/readyz", timeout=30).status_code == 200
                except httpx.HTTPError:
                    return False

            _until(ready, 600, "ready stack", period_s=2)
            # more requests at once than one replica's batch (max_num_seqs 16): the router packs
            # onto the oldest replica until its batch is full, so fewer would never reach the other
            wait_for_engine_replicas(stack, 2, concurrency=40)
            yield stack, cluster
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # serve run shuts the application down
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    for pid in stack_processes(home):  # the cluster is shut down with its holder; nothing may linger
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def test_the_survivor_serves_when_a_ray_node_is_lost(two_node_stack):
    from tests.helpers.invariants import settled
    from tests.helpers.replica_probe import ReplicaProbe

    stack, cluster = two_node_stack
    headers = stack.headers("acme")
    body = {"model": ADAPTER, "prompt": "the node", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ReplicaProbe(stack) as probe:
        views = probe.replicas()
        lost = [v["replica"] for v in views if cluster.on_worker(v["pid"])]
        assert len(views) == 2 and len(lost) == 1, [(v["replica"], v["pid"]) for v in views]
        survivor = next(v["replica"] for v in views if v["replica"] not in lost)
        before = complete(stack, headers, body)
        assert before.status == 200

        killed = cluster.lose_worker()
        lost_at = time.monotonic()
        statuses, answered = [], set()
        deadline = time.monotonic() + 90
        while statuses[-5:] != [200] * 5 and time.monotonic() < deadline:
            c = complete(stack, headers, body, timeout=120)
            statuses.append(c.status)
            assert c.status == 200 or (c.status == 503 and c.retry_after), (c.status, c.error)
            if c.status == 200:
                answered.add(c.replica)
                assert c.tokens == before.tokens  # the same adapter's greedy answer on the survivor
            else:
                time.sleep(0.5)
        assert statuses[-5:] == [200] * 5, statuses
        assert answered == {survivor}, (answered, survivor, lost)

        cluster.add_worker()  # what a cluster autoscaler does: Serve places the lost replica there

        def restored():
            now = probe.replicas()
            return (len(now) == 2 and lost[0] not in {v["replica"] for v in now}
                    and all(v.get("engine_alive") for v in now) and any(cluster.on_worker(v["pid"]) for v in now))

        _until(restored, 600, "replacement replica on the new node", period_s=3)
        print(f"\nnode lost: {len(killed)} processes killed; answers after it {statuses} (all 200 from {survivor}); "
              f"replica replaced on the new node {time.monotonic() - lost_at:.0f} s after the loss")
        assert settled(stack, probe, replicas=2) == []
        assert complete(stack, headers, body).status == 200
