"""Local disk cache of adapter files: content-addressed, byte-bounded LRU, atomic, verified.

``<root>/objects/<digest>/`` holds one adapter version's files (``digest`` =
:attr:`AdapterManifest.content_digest`, a sha256 over the files' sha256). A folder appears only
by ``rename`` from ``<root>/tmp/`` after every file's size and sha256 were checked, so a reader
never sees a partial folder. Entries found on disk at start-up are re-hashed on first use.

Pins: a pinned entry (an engine has its folder registered) is never evicted; the slots table
pins on ``add_lora`` and unpins after ``remove_lora``. Concurrent misses for one digest share one
download (single flight); downloads retry transient errors with exponential backoff.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import shutil
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import (
    AdapterInvalid,
    AdapterNotFound,
    CacheFull,
    CacheUnwritable,
    RegistryError,
    StoreUnavailable,
)
from .events import NO_OBSERVER, RegistryObserver
from .manifest import AdapterManifest
from .stores.base import AdapterStore
from .verify import sha256_file

log = logging.getLogger(__name__)
LocalCheck = Callable[[Path, AdapterManifest], None]


@dataclass
class CacheEntry:
    digest: str
    path: Path
    size: int
    pins: int = 0
    verified: bool = True
    last_used: float = 0.0


class AdapterCache:
    """Byte-bounded LRU of verified adapter folders (one per content digest)."""

    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        *,
        attempts: int = 3,
        backoff_s: float = 0.2,
        timeout_s: float = 300.0,
        local_check: LocalCheck | None = None,
        observer: RegistryObserver = NO_OBSERVER,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.local_check = local_check
        self.observer = observer
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._reserved = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "downloads": 0, "failures": 0}
        self._scan()

    # ---- state ----------------------------------------------------------------------------------
    def _scan(self) -> None:
        self.objects.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a crash are never complete
        self.tmp.mkdir(parents=True, exist_ok=True)
        found = []
        for d in self.objects.iterdir():
            if d.is_dir():
                size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                found.append((d.stat().st_mtime, CacheEntry(d.name, d, size, verified=False)))
        for _, e in sorted(found, key=lambda x: x[0]):
            self._entries[e.digest] = e
        self._publish_gauge()

    @property
    def used_bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(e.size for e in self._entries.values() if e.pins)

    def contains(self, manifest: AdapterManifest) -> bool:
        return manifest.content_digest in self._entries

    def path_of(self, manifest: AdapterManifest) -> Path:
        return self.objects / manifest.content_digest

    def snapshot(self) -> list[dict]:
        """Entries in LRU order (oldest first) for the admin view."""
        return [{"digest": e.digest, "bytes": e.size, "pins": e.pins} for e in self._entries.values()]

    def _publish_gauge(self) -> None:
        self.observer.cache_bytes(self.used_bytes)

    # ---- pins -----------------------------------------------------------------------------------
    def pin(self, manifest: AdapterManifest) -> None:
        e = self._entries.get(manifest.content_digest)
        if e is None:
            raise AdapterNotFound(f"{manifest.lora_name} is not in the local cache")
        e.pins += 1

    def unpin(self, manifest: AdapterManifest) -> None:
        e = self._entries.get(manifest.content_digest)
        if e is not None and e.pins > 0:
            e.pins -= 1

    async def release(self, manifest: AdapterManifest) -> None:
        """Drop one pin (the engine no longer has the folder registered)."""
        self.unpin(manifest)

    async def evict(self, manifest: AdapterManifest) -> bool:
        """Delete the entry now unless pinned; True if it was removed."""
        e = self._entries.get(manifest.content_digest)
        if e is None or e.pins:
            return False
        await self._drop(e)
        return True

    # ---- the read path --------------------------------------------------------------------------
    async def ensure_local(self, store: AdapterStore, manifest: AdapterManifest, *, pin: bool = False) -> Path:
        """A local folder with ``manifest``'s verified files; pinned once more if ``pin``."""
        digest = manifest.content_digest
        for _ in range(4):
            e = self._entries.get(digest)
            if e is not None and e.verified:
                if e.path.is_dir():
                    self.stats["hits"] += 1
                    self.observer.lookup("disk", hit=True)
                    return self._touch(e, pin)
                log.warning("cache folder %s vanished; fetching again", e.path)
                self._entries.pop(digest, None)
            task = self._inflight.get(digest)
            if task is None:
                self.stats["misses"] += 1
                self.observer.lookup("disk", hit=False)
                task = asyncio.ensure_future(self._load(store, manifest))
                self._inflight[digest] = task
                task.add_done_callback(self._load_done)
            await asyncio.shield(task)
            e = self._entries.get(digest)
            if e is not None and e.verified:  # no await since the load finished: still present
                return self._touch(e, pin)
        raise StoreUnavailable(f"{manifest.lora_name}: cache entry evicted repeatedly while loading; cache too small?")

    def _load_done(self, task: asyncio.Task) -> None:
        for d, t in list(self._inflight.items()):
            if t is task:
                del self._inflight[d]
        if not task.cancelled():
            task.exception()  # retrieved here so a load nobody waits for any more logs no warning

    def _touch(self, e: CacheEntry, pin: bool) -> Path:
        e.last_used = time.monotonic()
        self._entries.move_to_end(e.digest)
        if pin:
            e.pins += 1
        return e.path

    async def _load(self, store: AdapterStore, manifest: AdapterManifest) -> Path:
        digest = manifest.content_digest
        stale = self._entries.get(digest)
        if stale is not None and not stale.verified:
            if await asyncio.to_thread(self._verify_folder, stale.path, manifest):
                stale.verified = True
                return stale.path
            await self._drop(stale)
        size = manifest.total_bytes
        trash = self._make_room(size, manifest)  # synchronous: selection + reservation are atomic
        self._reserved += size
        for t in trash:
            await asyncio.to_thread(shutil.rmtree, t, True)
        t0 = time.perf_counter()
        try:
            path = await self._download_with_retries(store, manifest)
        except RegistryError as err:
            self.stats["failures"] += 1
            self.observer.failed("disk", type(err).__name__)
            raise
        finally:
            self._reserved -= size
        self.observer.loaded("disk", time.perf_counter() - t0)
        self.stats["downloads"] += 1
        self._entries[digest] = CacheEntry(digest, path, size, last_used=time.monotonic())
        self._publish_gauge()
        return path

    async def _download_with_retries(self, store: AdapterStore, manifest: AdapterManifest) -> Path:
        last: RegistryError | None = None
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + random.random()))
            tmp = self.tmp / f"{manifest.content_digest}-{uuid.uuid4().hex}"
            try:
                await asyncio.wait_for(asyncio.to_thread(self._fetch_into, store, manifest, tmp), self.timeout_s)
                return await asyncio.to_thread(self._commit, tmp, manifest)
            except asyncio.TimeoutError:
                last = StoreUnavailable(f"{manifest.lora_name}: download exceeded {self.timeout_s:.0f}s")
            except (StoreUnavailable, AdapterInvalid) as e:
                last = e  # transient, or a corrupt transfer that a retry may fix
            except AdapterNotFound:
                raise
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheFull(f"disk full under {self.root} while fetching {manifest.lora_name}: free space") from e
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and self._is_ours(e.filename):
                    raise CacheUnwritable(
                        f"the disk cache under {self.root} is not writable ({e.strerror}) while fetching "
                        f"{manifest.lora_name}: make it writable or point cache_dir elsewhere"
                    ) from e
                last = StoreUnavailable(f"{manifest.lora_name}: I/O error while fetching: {e}")
            finally:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
            log.warning("fetch of %s failed (attempt %d/%d): %s", manifest.lora_name, attempt + 1, self.attempts, last)
        assert last is not None
        raise last

    def _is_ours(self, filename: str | bytes | None) -> bool:
        """Whether an ``OSError``'s file lies in this cache (not in a local store)."""
        return isinstance(filename, str) and Path(filename).is_relative_to(self.root)

    def _fetch_into(self, store: AdapterStore, manifest: AdapterManifest, tmp: Path) -> None:
        store.download(manifest, tmp)
        if self.local_check is not None:
            self.local_check(tmp, manifest)

    def _commit(self, tmp: Path, manifest: AdapterManifest) -> Path:
        final = self.objects / manifest.content_digest
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Same content already there (another process): keep it.
        return final

    def _verify_folder(self, path: Path, manifest: AdapterManifest) -> bool:
        try:
            for f in manifest.files:
                if sha256_file(path / f.name) != (f.sha256, f.size):
                    return False
            return True
        except OSError:
            return False

    # ---- eviction -------------------------------------------------------------------------------
    def _make_room(self, size: int, manifest: AdapterManifest) -> list[Path]:
        """Evict LRU unpinned entries until ``size`` more bytes fit; returns folders to delete."""
        if size > self.max_bytes:
            raise CacheFull(
                f"{manifest.lora_name} is {size} bytes, larger than the whole cache bound {self.max_bytes}; "
                "raise cache_max_bytes"
            )
        free = shutil.disk_usage(self.root).free
        victims: list[CacheEntry] = []
        need = self.used_bytes + self._reserved + size - self.max_bytes
        for e in self._entries.values():
            if need <= 0:
                break
            if not e.pins and e.digest not in self._inflight:
                victims.append(e)
                need -= e.size
        if need > 0:
            raise CacheFull(
                f"cannot fit {manifest.lora_name} ({size} bytes): {self.pinned_bytes} of {self.max_bytes} cache "
                f"bytes are pinned by adapters the engine holds and {self._reserved} are being downloaded; "
                "retry later or raise cache_max_bytes",
                retry_after_s=2.0,
            )
        # Downloads in flight will take up to their whole size (counted in full even where part of
        # it is written already): two concurrent misses must not both start on room for one.
        if free - self._reserved + sum(v.size for v in victims) < size:
            raise CacheFull(
                f"disk under {self.root} has {free} bytes free, {self._reserved} of them promised to downloads in "
                f"flight; {manifest.lora_name} needs {size}: free disk space or retry later",
                retry_after_s=2.0,
            )
        return [t for v in victims if (t := self._unlink_entry(v)) is not None]

    def _unlink_entry(self, e: CacheEntry) -> Path | None:
        """Forget ``e`` and move its folder to trash (invisible at once); the caller deletes the trash."""
        self._entries.pop(e.digest, None)
        self.stats["evictions"] += 1
        self.observer.evicted("disk")
        self._publish_gauge()
        trash = self.tmp / f"trash-{uuid.uuid4().hex}"
        try:
            os.rename(e.path, trash)
        except FileNotFoundError:
            return None
        return trash

    async def _drop(self, e: CacheEntry) -> None:
        trash = self._unlink_entry(e)
        if trash is not None:
            await asyncio.to_thread(shutil.rmtree, trash, True)
