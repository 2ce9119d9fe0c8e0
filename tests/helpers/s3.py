"""Local S3-compatible servers on 127.0.0.1 for tests and benchmarks: moto in-process
(``MotoS3``), or a child process (``S3ServerProcess``: ``moto_server``, or ``s3rver`` from npm,
the one that stores on disk and checks credentials), with matching credentials in the
environment while they run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

from tests.helpers.environment import environment
from tests.helpers.net import free_port
from tests.helpers.paths import REPO

S3RVER_SCRIPT = REPO / "scripts" / "s3rver.sh"


S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "loraplex-test",
    "AWS_SECRET_ACCESS_KEY": "loraplex-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _LocalS3:
    """What both local S3 servers share: an endpoint on 127.0.0.1, credentials in the environment
    while running (restored after), a boto3 client, bucket creation."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._env = ExitStack()

    def _set_env(self, env: dict[str, str]) -> None:
        self._env.enter_context(environment(env))

    def _restore_env(self) -> None:
        self._env.close()

    def client(self):
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


class MotoS3(_LocalS3):
    """moto's S3 server on 127.0.0.1 (in-process thread), with test credentials in the environment."""

    def __enter__(self) -> "MotoS3":
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._set_env(S3_TEST_ENV)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        self._restore_env()


class S3ServerProcess(_LocalS3):
    """A local S3 server in a child process on 127.0.0.1: ``moto`` (``moto_server``, in memory,
    any key) or ``s3rver`` (npm, on disk under ``data_dir``, checks keys: S3RVER/S3RVER).
    Sets the matching credentials in the environment while running."""

    def __init__(self, kind: Literal["moto", "s3rver"], data_dir: str | Path | None = None, s3rver_prefix: str | Path | None = None):
        super().__init__()
        self.kind = kind
        self.data_dir = Path(data_dir) if data_dir else None
        self.s3rver_prefix = Path(s3rver_prefix) if s3rver_prefix else None

    def credentials(self) -> dict[str, str]:
        if self.kind == "s3rver":
            return {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}
        return dict(S3_TEST_ENV)

    def __enter__(self) -> "S3ServerProcess":
        if self.kind == "moto":
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            assert self.data_dir is not None and self.s3rver_prefix is not None
            cmd = ["bash", str(S3RVER_SCRIPT), "run", str(self.s3rver_prefix), str(self.data_dir), str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._set_env(self.credentials())
        client = self.client()
        deadline = time.monotonic() + 30
        while True:
            try:
                client.list_buckets()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"{self.kind} did not start on {self.endpoint}")
                time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._restore_env()


S3RVER_PREFIX = Path(sys.prefix) / "s3rver"  # where ``scripts/setup.sh --test`` installs it


def s3rver_prefix() -> Path:
    """The npm prefix holding s3rver (installed by ``scripts/setup.sh --test``); raises with
    what to run when it is not there: the s3rver tests are never skipped."""
    if not (S3RVER_PREFIX / "node_modules" / ".bin" / "s3rver").exists():
        raise RuntimeError(f"s3rver is not installed under {S3RVER_PREFIX}: run "
                           "`bash scripts/setup.sh --test` (needs Node.js and npm)")
    return S3RVER_PREFIX
