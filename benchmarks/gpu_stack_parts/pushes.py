"""The adapter store of the run: a moto S3 server on 127.0.0.1 (a child process), and adapters
published to it with ``loraplex adapters push``, each timed.

moto keeps an object in memory up to ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` bytes and in a
temporary file beyond; its temporary files go under the run's folder (``in_memory``: objects
stay in memory, for hosts with more memory than disk).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_stack_parts.models import PushRecord
from benchmarks.stacks.process import base_env
from tests.helpers.environment import environment

BUCKET = "loraplex-adapters"
PREFIX = "bench"
IN_MEMORY_BYTES = 4 << 30
# One PUT per file: moto spends most of a multipart upload on its own bookkeeping (an MD5 per
# part, then the parts copied into one object and their checksums combined at completion), so a
# single PUT of the 0.7 GiB adapter takes about half the time of 32 MiB parts.
UPLOAD_PART_MIB = 1024
PUSH_THREADS = 2
PUSH_NICE = 10


def _lower_priority() -> None:
    """In the push's child before it runs: below the server's CPU priority."""
    os.nice(PUSH_NICE)


@dataclass
class Store:
    uri: str
    endpoint: str
    env: dict[str, str]  # credentials and endpoint for a child process


@contextmanager
def local_s3(workdir: Path, in_memory: bool = False) -> Iterator[Store]:
    """moto on a free port with the bucket created; stopped on exit."""
    from tests.helpers.s3 import S3ServerProcess

    spool = workdir / "s3-objects"
    spool.mkdir(parents=True, exist_ok=True)
    server_env = {"TMPDIR": str(spool)}  # the server's temporary files (it inherits this environment)
    if in_memory:
        server_env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(IN_MEMORY_BYTES)
    with environment(server_env):
        server = S3ServerProcess("moto").__enter__()
    try:
        server.make_bucket(BUCKET)
        yield Store(uri=f"s3://{BUCKET}/{PREFIX}", endpoint=server.endpoint,
                    env={**server.credentials(), "AWS_ENDPOINT_URL": server.endpoint})
    finally:
        server.__exit__(None, None, None)


@contextmanager
def running_s3(endpoint: str) -> Iterator[Store]:
    """An S3 server already running at ``endpoint`` (moto started by an earlier command in its own
    process session, so that it outlives that command and keeps what was pushed to it), with the
    bucket made if missing; left running on exit. The test credentials are set in this process's
    environment while inside (as ``local_s3`` does)."""
    import boto3
    from botocore.exceptions import ClientError

    from tests.helpers.s3 import S3_TEST_ENV

    with environment(S3_TEST_ENV):
        client = boto3.session.Session().client("s3", endpoint_url=endpoint)
        try:
            client.create_bucket(Bucket=BUCKET)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        yield Store(uri=f"s3://{BUCKET}/{PREFIX}", endpoint=endpoint, env={**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})


def published(store: Store) -> set[str]:
    """Ids of the adapters the store already holds a version of."""
    from adapters_registry.stores import open_store

    opened = open_store(store.uri, store.endpoint)
    try:
        return {m.adapter_id for m in opened.list()}
    finally:
        opened.close()


def push(ctx, folder: Path, adapter: str, tenant: str, rank: int) -> PushRecord:
    """``loraplex adapters push`` of one folder into the run's store (validated against the
    model folder; GPT-OSS's fused 3-D expert layout kept, as vLLM loads it for that model)."""
    cfg = ctx.serve_cfg["applications"][0]["args"]["engine"]
    cmd = [sys.executable, "-m", "app.cli.main", "adapters", "push", str(folder), "--id", adapter, "--tenant", tenant,
           "--store", ctx.store.uri, "--endpoint-url", ctx.store.endpoint, "--base-model", str(ctx.assets.model_dir),
           "--max-lora-rank", str(cfg["max_lora_rank"]),
           "--upload-part-mib", str(UPLOAD_PART_MIB)]
    if ctx.assets.gpu:
        cmd.append("--keep-layout")
    # The pushes share the host with the starting server: they run niced and on few threads (the
    # validation's NaN scan would take every core), so the server's start is not theirs to slow.
    env = base_env({"OMP_NUM_THREADS": str(PUSH_THREADS), **ctx.store.env})
    t0 = time.perf_counter()
    r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, preexec_fn=_lower_priority)
    seconds = time.perf_counter() - t0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    size = re.search(r"(\d+) bytes\)", last)
    return PushRecord(adapter=adapter, tenant=tenant, rank=rank, seconds=seconds, ok=r.returncode == 0,
                      bytes=int(size.group(1)) if size else None, output=last[:500])
