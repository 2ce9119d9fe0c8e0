"""Every engine replica of a running stack, each reached by itself.

``/admin/residency`` is answered by whichever engine replica the router picks: with idle replicas
Serve breaks the tie the same way every time, so repeated calls never see the others. The probe
is a Ray driver attached to the stack's own cluster (its GCS address from the stack's Ray temp
dir) in a child process, so the test process never becomes a Ray driver. It lists the Engine
deployment's replica actors and calls ``residency`` on each actor directly, the way Serve's own
router calls a replica (``handle_request`` with Serve's ``RequestMetadata``: Serve-internal, as
pinned in pyproject), and reads each actor's pid. Commands and answers are JSON lines.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.json_lines_child import JsonLinesChild
from tests.helpers.paths import pythonpath_with_repo

ENGINE_PREFIX = "SERVE_REPLICA::loraplex#Engine#"


class ReplicaProbe(JsonLinesChild):
    """``with ReplicaProbe(stack) as probe: probe.replicas()`` → one residency dict per live
    engine replica, with ``pid`` (its actor process) added."""

    what = "replica probe"

    def __init__(self, stack) -> None:
        self.ray_tmp = stack.env["RAY_TMPDIR"]

    def __enter__(self) -> "ReplicaProbe":
        self._spawn(__name__, self.ray_tmp, env=dict(os.environ, RAY_AUTH_MODE="token",
                                                     RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                                                     PYTHONPATH=pythonpath_with_repo()))
        self._send("ping")
        return self

    def __exit__(self, *exc) -> None:
        self._close(30)

    def replicas(self) -> list[dict]:
        return self._send("residency")["result"]

    def engine_processes(self) -> dict[str, list[int]]:
        """Per live replica, every process under its actor: its vLLM engine core, workers and their
        helpers, whatever their titles (a replica's engine, to stop or to kill)."""
        import psutil

        return {v["replica"]: [p.pid for p in psutil.Process(v["pid"]).children(recursive=True)]
                for v in self.replicas()}


# ---- the child: an attached Ray driver -----------------------------------------------------------


def _gcs_address(ray_tmp: str) -> str:
    session = Path(ray_tmp) / "ray" / "session_latest"
    port_file = next(session.glob("gcs_server_port_*"))
    return f"127.0.0.1:{port_file.read_text().strip()}"


def _residencies() -> list[dict]:
    import pickle
    import uuid

    import ray
    from ray.serve._private.common import RequestMetadata

    out = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != "serve" or not actor["name"].startswith(ENGINE_PREFIX):
            continue
        meta = RequestMetadata(request_id=uuid.uuid4().hex, internal_request_id=uuid.uuid4().hex,
                               call_method="residency", app_name="loraplex")
        try:
            try:
                handle = ray.get_actor(actor["name"], namespace="serve")
            except ValueError:  # listed, then gone (a replica being replaced)
                continue
            pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            try:
                view = ray.get(handle.handle_request.remote(pickle.dumps(meta)), timeout=60)
            except ray.exceptions.RayTaskError as exc:  # the replica answers, its method failed
                view = {"replica": actor["name"].removeprefix(ENGINE_PREFIX), "error": str(exc)[-2000:]}
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            continue  # stopped between listing and calling: not a live replica
        except ray.exceptions.GetTimeoutError:  # alive but not answering (its engine just died, say)
            out.append({"replica": actor["name"].removeprefix(ENGINE_PREFIX), "error": "no answer within 60 s"})
            continue
        out.append({**view, "pid": pid})
    return sorted(out, key=lambda v: v["replica"])


def main(ray_tmp: str) -> None:
    import ray

    ray.init(address=_gcs_address(ray_tmp), logging_level="ERROR", log_to_driver=False, namespace="loraplex-probe")
    for line in sys.stdin:
        command = line.strip()
        try:
            result = "pong" if command == "ping" else _residencies()
            answer = {"result": result}
        except Exception as exc:  # reported to the test, which fails with it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
