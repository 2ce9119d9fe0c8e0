"""Progress bars of the benchmarks: tqdm on stderr, shown only when stderr is a terminal (so
captured runs and their tables stay clean)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "req") -> Iterator[T]:
    """``items`` with a bar named ``desc`` (``total`` when ``items`` has no length)."""
    return iter(tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True))


def progress_bar(total: int, desc: str, unit: str = "req") -> tqdm:
    """A bar to ``update()`` by hand (concurrent workers); close it when done."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False, dynamic_ncols=True)
