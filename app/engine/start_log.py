"""The phases of an engine replica's start, each logged with its seconds as it ends.

A replica's start is long (engine core process, weights, CUDA graphs, the shape warm-up), and a
slow one says nothing while it waits; this logs what took the time and keeps it for the
residency view. ``LORAPLEX_START_STACKS_S`` adds periodic stack dumps of every vLLM process
(``kernels.vllm.plugin.stack_dumps_from_env``); the replica's own stop once its start is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)


class StartPhase(BaseModel):
    """One phase of a start."""

    name: str = Field(description="What ran.")
    seconds: float = Field(description="Wall seconds it took.")


class StartLog:
    """Phases in order; ``phase(name)`` times one (a failing phase is logged, then re-raised)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.phases: list[StartPhase] = []
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        except BaseException:
            logger.error("replica %s start: %s failed after %.1f s", self.replica, name, time.perf_counter() - t)
            raise
        self.phases.append(StartPhase(name=name, seconds=round(time.perf_counter() - t, 3)))
        logger.info("replica %s start: %s %.1f s", self.replica, name, self.phases[-1].seconds)

    def done(self) -> float:
        """Total seconds since the log began; logs the phases on one line and ends this process's
        stack dumps."""
        from kernels.vllm.plugin import stop_stack_dumps

        stop_stack_dumps()
        total = time.perf_counter() - self._t0
        logger.info("replica %s started in %.1f s: %s", self.replica, total,
                    ", ".join(f"{p.name} {p.seconds:.1f} s" for p in self.phases))
        return total
