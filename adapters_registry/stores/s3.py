"""S3 adapter store (``s3://bucket/prefix``): plain boto3, endpoint from the argument or ``AWS_ENDPOINT_URL``.

Atomicity: publishing claims ``<v>/.claim`` with a conditional put (``If-None-Match: *``; a
racing publisher gets 412 and takes the next number; on servers without conditional writes a
read-back of the claim token narrows the race to milliseconds), uploads the files, and writes
``<v>/manifest.json`` last: readers list only versions whose manifest exists, so they never see
a partial version. Removal deletes the manifest first. Downloads stream one GET per file and
hash it on a helper thread as bytes arrive; with ``concurrency > 1`` large files come as
parallel ranged GETs pinned to the first response's ETag (a file replaced mid-download fails
instead of mixing bytes), hashed in order while later ranges are still in flight. The SDK's own
response checksum (a CRC32 of the whole body, on the reading thread, for objects written in one
PUT) is off: every byte is verified against the manifest's sha256 parts anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Iterator

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ..errors import AdapterConflict, AdapterNotFound, RegistryError, StoreUnavailable
from ..manifest import MANIFEST_NAME, AdapterManifest
from .base import CHANGES_NAME, TOMBSTONE_NAME, AdapterStore, BytesDone, corrupt_error

CLAIM_NAME = ".claim"
NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken", "ExpiredToken"}


class ObjectChanged(StoreUnavailable):
    """The object was replaced while being read (ETag changed); a retry reads the new state."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URI without bucket: {uri}")
    return bucket, prefix.strip("/")


class S3AdapterStore(AdapterStore):
    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        max_attempts: int = 3,
        part_bytes: int = 32 * 2**20,
        concurrency: int = 1,
    ) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                max_pool_connections=concurrency + 4,
                response_checksum_validation="when_required",  # sha256 parts verify every byte already
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=concurrency
        )

    def _key(self, *parts: str | int) -> str:
        return "/".join([p for p in [self.prefix] if p] + [str(x) for x in parts])

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Map boto errors to registry errors that say what to fix."""
        try:
            yield
        except RegistryError:
            raise
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in NOT_FOUND or status == 404 and code != "NoSuchBucket":
                raise AdapterNotFound(f"{what}: not found in {self.uri}") from None
            if code == "NoSuchBucket":
                raise StoreUnavailable(f"{what}: bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}; create it") from None
            if code in DENIED or status == 403:
                raise StoreUnavailable(f"{what}: access denied by {self.uri} ({code}); check the S3 credentials") from None
            if code in ("PreconditionFailed", "412") or status == 412:
                raise ObjectChanged(f"{what}: changed in {self.uri} while being read; retry") from None
            raise StoreUnavailable(f"{what}: S3 error {code or status} from {self.uri}: {e}") from None
        except (BotoCoreError, OSError) as e:
            raise StoreUnavailable(
                f"{what}: S3 endpoint {self.endpoint_url or 'AWS'} unreachable or too slow ({type(e).__name__}: {e}); retry later"
            ) from None

    def _list(self, prefix: str, delimiter: str | None = None) -> tuple[list[str], list[str]]:
        keys, prefixes = [], []
        kw = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        with self._errors(f"listing {prefix or '/'}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                keys += [o["Key"] for o in page.get("Contents", [])]
                prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        return keys, prefixes

    def _get_bytes(self, key: str, what: str) -> bytes:
        with self._errors(what):
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    # ---- primitives -------------------------------------------------------------------------------
    def _adapter_ids(self) -> list[str]:
        # A full listing, not Delimiter="/": some S3 servers (s3rver 3.7) drop common prefixes.
        root = self._key("") if self.prefix else ""
        keys, _ = self._list(root)
        ids = {k[len(root):].partition("/")[0] for k in keys}
        return sorted(i for i in ids if i and not i.startswith("."))

    def _versions(self, adapter_id: str) -> list[int]:
        base = self._key(adapter_id, "")
        keys, _ = self._list(base)
        out = []
        for k in keys:
            v, _, name = k[len(base):].partition("/")
            if name == MANIFEST_NAME and v.isdigit():
                out.append(int(v))
        return sorted(out)

    def _read_manifest(self, adapter_id: str, version: int) -> bytes:
        return self._get_bytes(self._key(adapter_id, version, MANIFEST_NAME), f"adapter {adapter_id}@v{version}")

    def _read_tombstone(self, adapter_id: str) -> int:
        try:
            raw = self._get_bytes(self._key(adapter_id, TOMBSTONE_NAME), "tombstone")
        except AdapterNotFound:
            return 0
        return int(json.loads(raw)["last_version"])

    def _write_tombstone(self, adapter_id: str, last_version: int) -> None:
        with self._errors(f"deleting {adapter_id}"):
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(adapter_id, TOMBSTONE_NAME),
                Body=json.dumps({"last_version": last_version}).encode(),
            )

    def _read_changes(self) -> str | None:
        try:
            return self._get_bytes(self._key(CHANGES_NAME), "change marker").decode()
        except AdapterNotFound:
            return None

    def _write_changes(self, token: str) -> None:
        with self._errors("writing the change marker"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(CHANGES_NAME), Body=token.encode())

    def _commit_version(self, adapter_id: str, version: int, files: dict[str, Path], manifest: bytes,
                        on_bytes: BytesDone | None = None) -> None:
        what = f"publishing {adapter_id}@v{version}"
        token = uuid.uuid4().hex.encode()
        claim_key = self._key(adapter_id, version, CLAIM_NAME)
        with self._errors(what):
            if self._exists(self._key(adapter_id, version, MANIFEST_NAME)):
                raise AdapterConflict(f"{adapter_id}@v{version} already published")
            try:
                self.client.put_object(Bucket=self.bucket, Key=claim_key, Body=token, IfNoneMatch="*")
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise AdapterConflict(f"{adapter_id}@v{version} claimed by a concurrent publish") from None
                raise
            for name, path in files.items():
                self.client.upload_file(str(path), self.bucket, self._key(adapter_id, version, name),
                                        Config=self.transfer, Callback=on_bytes)
            # Servers that ignore If-None-Match (s3rver) let two claims "succeed": the later one
            # wins the claim object, and the earlier publisher backs off here (best effort).
            if self.client.get_object(Bucket=self.bucket, Key=claim_key)["Body"].read() != token:
                raise AdapterConflict(f"{adapter_id}@v{version} claimed by a concurrent publish")
            try:
                self.client.put_object(
                    Bucket=self.bucket, Key=self._key(adapter_id, version, MANIFEST_NAME), Body=manifest, IfNoneMatch="*"
                )
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise AdapterConflict(f"{adapter_id}@v{version} published concurrently") from None
                raise

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in NOT_FOUND or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise

    def _remove_version(self, adapter_id: str, version: int) -> None:
        base = self._key(adapter_id, version, "")
        with self._errors(f"deleting {adapter_id}@v{version}"):
            self.client.delete_object(Bucket=self.bucket, Key=base + MANIFEST_NAME)  # invisible from here on
            keys, _ = self._list(base)
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
                )

    # ---- reads ------------------------------------------------------------------------------------
    def open_file(self, manifest: AdapterManifest, name: str) -> BinaryIO:
        manifest.file(name)
        key = self._key(manifest.adapter_id, manifest.version, name)
        with self._errors(f"{manifest.lora_name}/{name}"):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        return _ErrorMappingReader(body, self, f"{manifest.lora_name}/{name}")

    def download_file(self, manifest: AdapterManifest, name: str, dest: Path) -> None:
        """One streamed GET (``concurrency == 1``, the default: fastest on loopback servers) or
        parallel ranged GETs (``concurrency > 1``: for stores that cap per-connection throughput).
        Ranged: with part hashes in the manifest each range is one part, verified and written by
        the thread that fetched it; without, ranges are hashed in order as they arrive."""
        expected = manifest.file(name)
        if self.concurrency <= 1 or expected.size <= self.part_bytes:
            return super().download_file(manifest, name, dest)
        key = self._key(manifest.adapter_id, manifest.version, name)
        what = f"{manifest.lora_name}/{name}"
        parts = expected.part_sha256 if expected.part_bytes else []
        step = expected.part_bytes if parts else self.part_bytes
        assert step
        ranges = [(o, min(o + step, expected.size)) for o in range(0, expected.size, step)]
        if parts and len(parts) != len(ranges):
            raise corrupt_error(manifest, name, "manifest part hashes do not cover the file")
        with self._errors(what):
            first = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{ranges[0][1] - 1}")
            total = int(str(first.get("ContentRange", "")).rpartition("/")[2] or -1)
            if total != expected.size:
                raise corrupt_error(manifest, name, f"{total} bytes in the store instead of {expected.size}")
            etag = first["ETag"]
            data0 = first["Body"].read()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

        def handle(i: int, data: bytes | None = None) -> bytes | None:
            lo, hi = ranges[i]
            if data is None:
                with self._errors(what):
                    r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}", IfMatch=etag)
                    data = r["Body"].read()
            if len(data) != hi - lo:
                raise corrupt_error(manifest, name, f"range {lo}-{hi} returned {len(data)} bytes: truncated")
            if parts and hashlib.sha256(data).hexdigest() != parts[i]:
                raise corrupt_error(manifest, name, f"sha256 mismatch in part {i} of {len(parts)}")
            os.pwrite(fd, data, lo)
            return None if parts else data

        h = hashlib.sha256()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-range")
        pending: list[Future[bytes | None]] = [pool.submit(handle, 0, data0)]
        del data0
        try:
            nxt = 1
            for i in range(len(ranges)):
                while nxt < len(ranges) and nxt <= i + 2 * self.concurrency:  # bounded memory
                    pending.append(pool.submit(handle, nxt))
                    nxt += 1
                data = pending.pop(0).result()
                if not parts:
                    h.update(data)  # type: ignore[arg-type]
            if not parts and h.hexdigest() != expected.sha256:
                raise corrupt_error(manifest, name, "sha256 mismatch")
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(fd)

    def close(self) -> None:
        self.client.close()


class _ErrorMappingReader(io.RawIOBase):
    """A streaming body whose read errors become registry errors."""

    def __init__(self, body, store: S3AdapterStore, what: str) -> None:
        self.body, self.store, self.what = body, store, what

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        with self.store._errors(self.what):
            return self.body.read(None if n < 0 else n)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.body.close()
        super().close()
