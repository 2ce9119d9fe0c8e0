"""A replica's start-up heap kept out of Python's garbage collector.

After its start a replica's process holds on the order of 10^6 objects the collector tracks
(torch, vLLM, Ray, FastAPI and pydantic models); a full collection walks every one of them and
holds the event loop meanwhile, so every stream of the replica stalls at once. Frozen when the
start is over (as vLLM's own OpenAI server does), they are never walked again: a full
collection then walks only what came after.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect, then move every object the collector tracks to its permanent generation; returns
    how many objects are frozen in all. Call at the end of a replica's start (again later: the
    objects made since join them)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects of the start-up heap frozen out of garbage collection", who, frozen)
    return frozen
