"""Hashing and verified copies of adapter files.

A published file carries its whole-file sha256 and, above ``PART_BYTES``, the sha256 of each
``part_bytes`` slice (``part_sha256``). Verifying every part is as strong as verifying the whole
hash (the manifest is the root of trust either way) but parallel: a copy hashes parts on several
threads while the next bytes are still arriving, so a large adapter is verified at network speed
instead of at one core's sha256 speed.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import BinaryIO, Callable

CHUNK = 8 * 2**20
PART_BYTES = 32 * 2**20
Corrupt = Callable[[str], BaseException]


def sha256_file(path: Path) -> tuple[str, int]:
    """``(hex sha256, size)`` of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def hash_file(path: Path, part_bytes: int = PART_BYTES) -> tuple[str, int, list[str]]:
    """``(whole sha256, size, part sha256s)``; no parts for files of at most ``part_bytes``."""
    whole = hashlib.sha256()
    parts: list[str] = []
    size = 0
    with open(path, "rb") as f:
        while part := f.read(part_bytes):
            whole.update(part)
            parts.append(hashlib.sha256(part).hexdigest())
            size += len(part)
    return whole.hexdigest(), size, parts if size > part_bytes else []


class _Pipeline:
    """Worker threads fed through bounded queues; the first failure is kept and re-raised."""

    def __init__(self) -> None:
        self.failure: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.queues: list[queue.Queue] = []

    def add(self, name: str, handle: Callable[[object], None]) -> queue.Queue:
        q: queue.Queue = queue.Queue(maxsize=8)

        def run() -> None:
            while (item := q.get()) is not None:
                if self.failure:
                    continue
                try:
                    handle(item)
                except BaseException as e:  # noqa: BLE001 - re-raised by the reading thread
                    self.failure.append(e)

        t = threading.Thread(target=run, name=f"loraplex-{name}", daemon=True)
        t.start()
        self.threads.append(t)
        self.queues.append(q)
        return q

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()


def copy_verified(
    src: BinaryIO,
    dest: Path,
    size: int,
    sha256: str,
    corrupt: Corrupt,
    part_bytes: int | None = None,
    part_sha256: list[str] | None = None,
) -> None:
    """Stream ``src`` into ``dest`` while verifying it; raise ``corrupt(why)`` on a wrong size or hash.

    This thread reads; one thread writes; hashing runs on one thread (whole-file sha256) or, when
    part hashes are given, on up to four threads (part k on thread k mod n). All of them release
    the GIL in their heavy part.
    """
    use_parts = bool(part_sha256) and part_bytes is not None and part_bytes > 0
    pipe = _Pipeline()
    out = open(dest, "wb")
    to_write = pipe.add("write", lambda mv: out.write(mv))
    whole = hashlib.sha256()
    n_hashers = min(4, max(1, (os.cpu_count() or 2) - 1)) if use_parts else 1
    digests: dict[int, str] = {}
    partial: dict[int, "hashlib._Hash"] = {}

    def hash_piece(item) -> None:
        k, last, mv = item
        if not use_parts:
            whole.update(mv)
            return
        h = partial.setdefault(k, hashlib.sha256())
        h.update(mv)
        if last:
            digests[k] = partial.pop(k).hexdigest()

    hashers = [pipe.add(f"hash{i}", hash_piece) for i in range(n_hashers)]
    got = 0
    try:
        while not pipe.failure and (chunk := src.read(CHUNK)):
            if got + len(chunk) > size:
                raise corrupt(f"larger than the manifest's {size} bytes")
            mv = memoryview(chunk)
            to_write.put(mv)
            pos = 0
            while pos < len(mv):  # split at part boundaries (zero-copy views)
                k = (got + pos) // part_bytes if use_parts else 0
                end = min(len(mv), (k + 1) * part_bytes - got) if use_parts else len(mv)
                last = use_parts and (got + end) % part_bytes == 0 or (got + end) == size
                hashers[k % n_hashers].put((k, last, mv[pos:end]))
                pos = end
            got += len(mv)
    finally:
        pipe.close()
        out.close()
    if pipe.failure:
        raise pipe.failure[0]
    if got != size:
        raise corrupt(f"{got} bytes instead of {size}: truncated")
    if use_parts:
        bad = [k for k, want in enumerate(part_sha256 or []) if digests.get(k) != want]
        if bad or len(digests) != len(part_sha256 or []):
            raise corrupt(f"sha256 mismatch in part {bad[0] if bad else len(digests)} of {len(part_sha256 or [])}")
    elif whole.hexdigest() != sha256:
        raise corrupt("sha256 mismatch")
