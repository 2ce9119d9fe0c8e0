"""A Ray cluster of two nodes on this machine (Ray's own ``ray.cluster_utils.Cluster``), held by
a child process so the test process never becomes a Ray driver or a node's parent.

``with TwoNodeCluster(env) as cluster:`` starts a head node (custom resource ``lpx_head``) and
one worker node; ``cluster.address`` is the GCS address for ``serve run --address``;
``cluster.lose_worker()`` SIGKILLs the worker node's raylet and every process under it (its
Ray workers, the replicas' engine processes) at once, as if the machine had vanished, then
removes what is left of the node; ``cluster.add_worker()`` joins a fresh worker node (what
a cluster autoscaler does next). Commands and answers are JSON lines on the child's stdio.
"""

from __future__ import annotations

import json
import sys

import psutil

from tests.helpers.json_lines_child import JsonLinesChild

HEAD_RESOURCE = "lpx_head"
NODE_CPUS = 2


class TwoNodeCluster(JsonLinesChild):
    what = "two-node cluster"

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __enter__(self) -> "TwoNodeCluster":
        self._spawn(__name__, env=self.env)
        started = self._answer()
        self.address, self.worker_raylet_pid = started["address"], started["worker_raylet_pid"]
        return self

    def __exit__(self, *exc) -> None:
        self._close(120)  # the child shuts the cluster down

    def on_worker(self, pid: int) -> bool:
        """Whether ``pid`` runs under the worker node's raylet."""
        return any(p.pid == self.worker_raylet_pid for p in psutil.Process(pid).parents())

    def lose_worker(self) -> list[int]:
        """The worker node gone at once; the pids that were killed."""
        return self._send("lose-worker")["killed"]

    def add_worker(self) -> None:
        """A new worker node joined (``on_worker`` then means under its raylet)."""
        self.worker_raylet_pid = self._send("add-worker")["worker_raylet_pid"]


# ---- the child: holds the cluster ----------------------------------------------------------------


def _kill_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    return [p.pid for p in procs]


def main() -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
        "num_cpus": NODE_CPUS, "resources": {HEAD_RESOURCE: 1}, "include_dashboard": False})

    def add_worker():
        node = cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        return node, node.all_processes["raylet"][0].process.pid

    worker, raylet = add_worker()
    print(json.dumps({"address": cluster.address, "worker_raylet_pid": raylet}), flush=True)
    try:
        for line in sys.stdin:
            try:
                if line.strip() == "lose-worker":
                    killed = _kill_tree(raylet)
                    cluster.remove_node(worker, allow_graceful=False)
                    answer = {"killed": killed}
                elif line.strip() == "add-worker":
                    worker, raylet = add_worker()
                    answer = {"worker_raylet_pid": raylet}
                else:
                    answer = {"error": f"unknown command {line.strip()!r}"}
            except Exception as exc:  # reported to the test, which fails with it
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
