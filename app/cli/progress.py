"""Progress bars of the CLI (tqdm on stderr, shown only when stderr is a terminal)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable


@contextmanager
def byte_progress(desc: str) -> Iterator[Callable[[int, int], None]]:
    """Yields ``progress(bytes_done, bytes_total)`` driving one byte bar; the bar closes after."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
            bar.refresh()
        bar.update(done)

    try:
        yield progress
    finally:
        bar.close()
