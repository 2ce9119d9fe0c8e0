"""The adapter store interface, shared publish/read logic, and ``open_store``.

Layout (local directory and S3 alike)::

    <prefix>/<adapter_id>/<version>/adapter_config.json
    <prefix>/<adapter_id>/<version>/adapter_model.safetensors
    <prefix>/<adapter_id>/<version>/manifest.json      # written last: its presence = version complete
    <prefix>/<adapter_id>/tombstone.json               # after a delete: last version number used
    <prefix>/.changes                                  # a new random token after every publish and delete

Versions count up from 1 and are never reused, even across delete and re-push, so a replica
never mistakes new bytes for an old version it still holds. All methods are synchronous
(blocking I/O): call them through ``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import BinaryIO, Callable

BytesDone = Callable[[int], None]  # called with the bytes just written (upload progress)
Progress = Callable[[int, int], None]  # (bytes just written, total bytes to write)

from ..errors import AdapterConflict, AdapterInvalid, AdapterNotFound
from ..manifest import MANIFEST_NAME, AdapterManifest, BaseModelInfo, ManifestFile
from ..normalise import TargetLayout, prepare_files
from ..validation import ValidationLimits, check_id, inspect_adapter
from ..verify import CHUNK, PART_BYTES, copy_verified, hash_file

TOMBSTONE_NAME = "tombstone.json"
CHANGES_NAME = ".changes"
PUBLISH_ATTEMPTS = 8
logger = logging.getLogger(__name__)


def corrupt_error(manifest: AdapterManifest, name: str, why: str) -> AdapterInvalid:
    return AdapterInvalid(
        f"{manifest.lora_name}/{name} in the store is corrupt ({why}); re-push the adapter "
        f"(`loraplex adapters push`) to publish a good version"
    )


class AdapterStore(ABC):
    """A versioned adapter store. Subclasses supply the storage primitives."""

    uri: str

    # ---- storage primitives -------------------------------------------------------------------
    @abstractmethod
    def _adapter_ids(self) -> list[str]:
        """Ids that have at least one version folder or a tombstone."""

    @abstractmethod
    def _versions(self, adapter_id: str) -> list[int]:
        """Complete versions (manifest present), ascending."""

    @abstractmethod
    def _read_manifest(self, adapter_id: str, version: int) -> bytes:
        """Manifest bytes; :class:`AdapterNotFound` when absent."""

    @abstractmethod
    def _read_tombstone(self, adapter_id: str) -> int:
        """Last version used before a delete (0: none)."""

    @abstractmethod
    def _write_tombstone(self, adapter_id: str, last_version: int) -> None: ...

    @abstractmethod
    def _commit_version(self, adapter_id: str, version: int, files: dict[str, Path], manifest: bytes,
                        on_bytes: BytesDone | None = None) -> None:
        """Make the version visible all at once; :class:`AdapterConflict` if it already exists.
        ``on_bytes`` is told about every chunk of the files written."""

    @abstractmethod
    def _remove_version(self, adapter_id: str, version: int) -> None:
        """Make the version invisible first (manifest), then remove its files."""

    @abstractmethod
    def _read_changes(self) -> str | None:
        """The change marker's token (None: never written)."""

    @abstractmethod
    def _write_changes(self, token: str) -> None: ...

    @abstractmethod
    def open_file(self, manifest: AdapterManifest, name: str) -> BinaryIO:
        """A readable binary stream of one file of a published version."""

    # ---- shared logic ---------------------------------------------------------------------------
    def publish(
        self,
        src_dir: str | Path,
        adapter_id: str,
        owner_tenant: str,
        base: BaseModelInfo,
        max_lora_rank: int = 64,
        limits: ValidationLimits | None = None,
        target_layout: TargetLayout = "2d",
        progress: Progress | None = None,
    ) -> AdapterManifest:
        """Validate ``src_dir`` against ``base`` and publish it as version last+1 (atomic);
        ``progress(bytes_done, bytes_total)`` follows the upload of the (normalised) files."""
        check_id(adapter_id)
        check_id(owner_tenant, "tenant name")
        if self._versions(adapter_id):
            owner = self.get(adapter_id).owner_tenant
            if owner != owner_tenant:
                raise AdapterConflict(f"adapter {adapter_id!r} belongs to tenant {owner!r}; pick another id")
        report = inspect_adapter(src_dir, base, max_lora_rank, limits)
        with tempfile.TemporaryDirectory(prefix="loraplex-publish-") as work:
            files, layout = prepare_files(Path(src_dir), base, report, Path(work), target_layout, max_lora_rank)
            entries = []
            for name, path in files.items():
                digest, size, parts = hash_file(path, PART_BYTES)
                entries.append(ManifestFile(name=name, sha256=digest, size=size,
                                            part_bytes=PART_BYTES if parts else None, part_sha256=parts))
            total = sum(e.size for e in entries)
            on_bytes = None if progress is None else (lambda n: progress(n, total))
            lost = 0  # highest version a concurrent publish claimed first: never retry it
            for _ in range(PUBLISH_ATTEMPTS):
                version = max([lost, self._read_tombstone(adapter_id), *self._versions(adapter_id)]) + 1
                manifest = AdapterManifest(
                    adapter_id=adapter_id,
                    version=version,
                    owner_tenant=owner_tenant,
                    base_model=base.ref,
                    rank=report.rank,
                    lora_alpha=report.lora_alpha,
                    target_modules=report.target_modules,
                    target_parameters=report.target_parameters,
                    has_expert_lora=report.has_expert_lora,
                    layout=layout,
                    source_layout=report.layout,
                    files=entries,
                )
                try:
                    self._commit_version(adapter_id, version, files, manifest.to_json_bytes(), on_bytes)
                    self._mark_changed()
                    return manifest
                except AdapterConflict:
                    lost = version  # its manifest may not be visible yet: try the next number
                    continue
            raise AdapterConflict(f"adapter {adapter_id!r}: {PUBLISH_ATTEMPTS} concurrent publishes won; retry")

    def get(self, adapter_id: str, version: int | None = None) -> AdapterManifest:
        """The manifest of ``version`` (default: the latest)."""
        check_id(adapter_id)
        if version is None:
            versions = self._versions(adapter_id)
            if not versions:
                raise AdapterNotFound(f"adapter {adapter_id!r} not found in {self.uri}; push it first")
            version = versions[-1]
        raw = self._read_manifest(adapter_id, version)
        try:
            return AdapterManifest.model_validate_json(raw)
        except ValueError as e:
            raise AdapterInvalid(f"manifest of {adapter_id}@v{version} is unreadable: {e}") from e

    def versions(self, adapter_id: str) -> list[int]:
        return self._versions(check_id(adapter_id))

    def list(self) -> list[AdapterManifest]:
        """The latest version of every adapter, sorted by id."""
        out = []
        for adapter_id in sorted(self._adapter_ids()):
            try:
                out.append(self.get(adapter_id))
            except AdapterNotFound:
                continue  # tombstone only, or deleted meanwhile
        return out

    def delete(self, adapter_id: str) -> list[int]:
        """Remove every version (invisible first, files after); returns the removed versions."""
        versions = self._versions(check_id(adapter_id))
        if not versions:
            raise AdapterNotFound(f"adapter {adapter_id!r} not found in {self.uri}")
        self._write_tombstone(adapter_id, max(versions[-1], self._read_tombstone(adapter_id)))
        for v in versions:
            self._remove_version(adapter_id, v)
        self._mark_changed()
        return versions

    def change_marker(self) -> str | None:
        """A token the store rewrites after every publish and delete has completed (None: none
        written yet). Equal tokens from two reads mean no publish or delete completed between
        them, so readers may keep what they read before the first one (``AdapterCatalog``)."""
        return self._read_changes()

    def _mark_changed(self) -> None:
        """After a publish or delete. A failed write is logged, not raised: the change itself is
        done, and readers re-read what they use within a bounded time without the marker."""
        try:
            self._write_changes(uuid.uuid4().hex)
        except Exception as exc:
            logger.warning("change marker of %s not written (readers see the change later): %r", self.uri, exc)

    def download_file(self, manifest: AdapterManifest, name: str, dest: Path) -> None:
        """Copy one file to ``dest`` verifying size and sha256 (:class:`AdapterInvalid` if corrupt).

        Pipelined (:func:`~adapters_registry.verify.copy_verified`): reading, writing and hashing
        overlap, and large files are verified part by part on several threads.
        """
        f = manifest.file(name)
        with self.open_file(manifest, name) as src:
            copy_verified(src, dest, f.size, f.sha256, lambda why: corrupt_error(manifest, name, why),
                          f.part_bytes, f.part_sha256)

    def download(self, manifest: AdapterManifest, dest_dir: str | Path) -> Path:
        """Download and verify every file of ``manifest`` into ``dest_dir`` (created)."""
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for f in manifest.files:
            self.download_file(manifest, f.name, dest / f.name)
        (dest / MANIFEST_NAME).write_bytes(manifest.to_json_bytes())
        return dest

    def close(self) -> None:
        """Release clients/connections (no-op by default)."""


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def copy_fsync(src: Path, dst: Path, on_bytes: BytesDone | None = None) -> None:
    with open(src, "rb") as a, open(dst, "wb") as b:
        while chunk := a.read(CHUNK):
            b.write(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
        b.flush()
        os.fsync(b.fileno())
