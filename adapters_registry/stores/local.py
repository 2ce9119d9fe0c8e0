"""Local-directory adapter store (``file:///path``): the embedded default, same layout as S3.

Atomicity: a version is assembled in ``<id>/.tmp-<random>/`` (manifest last, fsynced) and
appears with one ``rename`` to ``<id>/<version>``; rename onto an existing non-empty version
folder fails, which is how two racing publishes are told apart. Removal renames the version
folder to ``<id>/.trash-…`` (invisible at once) before deleting it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from ..errors import AdapterConflict, AdapterNotFound, StoreUnavailable
from ..manifest import MANIFEST_NAME, AdapterManifest
from ..validation import check_id
from .base import (
    CHANGES_NAME,
    TOMBSTONE_NAME,
    AdapterStore,
    BytesDone,
    copy_fsync,
    fsync_dir,
    read_json,
)


def path_from_uri(uri: str) -> Path:
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI with a host is not supported: {uri}")
        return Path(unquote(parsed.path))
    return Path(uri).expanduser()


class LocalAdapterStore(AdapterStore):
    def __init__(self, uri: str) -> None:
        self.root = path_from_uri(uri).resolve()
        self.uri = self.root.as_uri()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"local store {self.root} cannot be created: {e}") from e

    def _dir(self, adapter_id: str) -> Path:
        return self.root / check_id(adapter_id)

    def _adapter_ids(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def _versions(self, adapter_id: str) -> list[int]:
        d = self._dir(adapter_id)
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / MANIFEST_NAME).is_file())

    def _read_manifest(self, adapter_id: str, version: int) -> bytes:
        try:
            return (self._dir(adapter_id) / str(version) / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            raise AdapterNotFound(f"adapter {adapter_id}@v{version} not found in {self.uri}") from None

    def _read_tombstone(self, adapter_id: str) -> int:
        data = read_json(self._dir(adapter_id) / TOMBSTONE_NAME)
        return int(data["last_version"]) if data else 0

    def _write_tombstone(self, adapter_id: str, last_version: int) -> None:
        d = self._dir(adapter_id)
        tmp = d / f".tmp-{uuid.uuid4().hex}.json"
        tmp.write_text(json.dumps({"last_version": last_version}))
        os.replace(tmp, d / TOMBSTONE_NAME)

    def _read_changes(self) -> str | None:
        try:
            return (self.root / CHANGES_NAME).read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"local store {self.root}: change marker unreadable: {e}") from e

    def _write_changes(self, token: str) -> None:
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.write_text(token)
        os.replace(tmp, self.root / CHANGES_NAME)

    def _commit_version(self, adapter_id: str, version: int, files: dict[str, Path], manifest: bytes,
                        on_bytes: BytesDone | None = None) -> None:
        d = self._dir(adapter_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            for name, src in files.items():
                copy_fsync(src, tmp / name, on_bytes)
            with open(tmp / MANIFEST_NAME, "wb") as f:
                f.write(manifest)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            try:
                os.rename(tmp, d / str(version))
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise AdapterConflict(f"{adapter_id}@v{version} was published concurrently") from None
                raise
            fsync_dir(d)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _remove_version(self, adapter_id: str, version: int) -> None:
        d = self._dir(adapter_id)
        trash = d / f".trash-{version}-{uuid.uuid4().hex}"
        try:
            os.rename(d / str(version), trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def open_file(self, manifest: AdapterManifest, name: str) -> BinaryIO:
        manifest.file(name)  # KeyError for names outside the manifest: no path games
        try:
            return open(self._dir(manifest.adapter_id) / str(manifest.version) / name, "rb")
        except FileNotFoundError:
            raise AdapterNotFound(f"{manifest.lora_name}/{name} is gone from {self.uri} (deleted?)") from None
