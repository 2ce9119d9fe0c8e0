"""The child process of ``loraplex serve``: what ``serve run CONFIG`` does, then a watch that
``serve run`` lacks.

``serve run`` of a config starts a local Ray cluster, starts Serve with the config's proxy, HTTP,
gRPC and controller options, submits the applications and sleeps until SIGINT, whatever becomes
of them: an application Serve cannot build or start (an exception in the builder, replicas that
keep failing their constructor) leaves it serving nothing, forever. This driver does the same
start, then polls Serve's status and ends (exit 1, Serve shut down) with Serve's message when an
application reaches ``DEPLOY_FAILED``. SIGINT shuts Serve down and exits 0, as ``serve run``, and
so does SIGTERM, whatever dispositions the driver inherited (Python leaves SIGINT ignored when it
starts ignored, as in a shell's background job). While starting, a stop signal interrupts the start
(``KeyboardInterrupt``); once started, it only sets ``STOP_REQUESTED``, which the watch waits on, so
no signal can land between two handlers.

Ray internals used here, and nowhere else: ``ray.serve._private.api.serve_start`` and the
client's ``deploy_apps`` (what ``serve run`` calls; Ray 2.60). Another Ray version falls back to
``serve run`` itself (``command``).

    python -m app.cli.serve_driver CONFIG [--address ADDRESS]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

import yaml

RAY_SERIES = "2.60."  # the Ray whose serve run this reproduces
POLL_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what stops the driver, serve run and loraplex serve
STOP_REQUESTED = threading.Event()  # set by a stop signal once the start is over
_starting = False  # while True, a stop signal raises KeyboardInterrupt instead


def supported() -> bool:
    import ray

    return ray.__version__.startswith(RAY_SERIES)


def command(config: str, address: str = "local") -> list[str]:
    """The child's command line: this driver, or ``serve run`` on another Ray."""
    if supported():
        return [sys.executable, "-m", "app.cli.serve_driver", config, "--address", address]
    script = Path(sys.executable).with_name("serve")
    serve = [str(script)] if script.exists() else [sys.executable, "-c", "from ray.serve.scripts import cli; cli()"]
    return serve + ["run", "--address", address, config]


def failed_applications(status) -> dict[str, str]:
    """``name -> Serve's message`` of every application in ``DEPLOY_FAILED`` (``serve.status()``)."""
    return {name: app.message for name, app in status.applications.items() if app.status == "DEPLOY_FAILED"}


def start(config_path: Path, address: str):
    """Ray connected (a new local cluster for ``local``), Serve started with the config's
    options, its applications submitted; returns the client."""
    import ray
    from ray.serve._private import api as serve_api
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(config_path.read_text()))
    ray.init(address=address, namespace=SERVE_NAMESPACE)
    client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                   proxy_location=config.proxy_location,
                                   grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                                   controller_options=config.controller_options)
    client.deploy_apps(config, _blocking=False)
    print(f"submitted {config_path} to Serve", flush=True)
    return client


def watch(poll_s: float = POLL_S) -> int:
    """Until an application fails to deploy (1) or a stop signal (0); Serve is shut down either way."""
    from ray import serve

    while not STOP_REQUESTED.wait(poll_s):
        try:
            status = serve.status()
        except Exception as exc:  # noqa: BLE001 - the controller restarting, say: ask again later
            print(f"Serve's status not read ({type(exc).__name__}: {exc}); asking again", file=sys.stderr, flush=True)
            continue
        if failed := failed_applications(status):
            for name, message in failed.items():
                print(f"application {name!r} failed to deploy; Serve says:\n{message}", file=sys.stderr, flush=True)
            serve.shutdown()
            return 1
    print("stopping: shutting Serve down", flush=True)
    serve.shutdown()
    return 0


def _stop(signum: int, frame) -> None:
    if _starting:
        raise KeyboardInterrupt(signal.Signals(signum).name)
    STOP_REQUESTED.set()


def take_stop_signals() -> None:
    """The ``STOP_SIGNALS`` become the clean stop: ``KeyboardInterrupt`` while starting, else
    ``STOP_REQUESTED`` set."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop)


def default_stop_signals() -> None:
    """The ``STOP_SIGNALS``' default dispositions: in a child before ``exec`` (an ignored one is
    inherited, and Python keeps SIGINT ignored when it starts so)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.cli.serve_driver", description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--address", default="local", help="Ray address: local (a new cluster) or a cluster's GCS address")
    args = ap.parse_args(argv)
    global _starting
    _starting = True
    take_stop_signals()
    try:
        start(args.config, args.address)
        _starting = False  # a signal before this line interrupts inside the try; after it, sets the event
    except KeyboardInterrupt:
        print("stopped while starting: shutting Serve down", flush=True)
        _shutdown_if_connected()
        return 0
    return watch(POLL_S)


def _shutdown_if_connected() -> None:
    """Serve shut down if this process got as far as connecting to Ray (a stop mid-start)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()


if __name__ == "__main__":
    sys.exit(main())
