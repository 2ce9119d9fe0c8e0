"""The closed loop of a load phase (``run_workers``), its workers started together or spread.

With every request of a phase the same length, workers that start together stay together: each
wave of ``n`` prompts arrives at once, and TTFT then measures where a request falls in its wave's
prefill (how the waves happened to form), not the server. ``StaggeredStarts`` lets worker ``k``
(0 < k < n) send its first request once worker 0's first request has produced ``k / n`` of its
output tokens, or ended: arrivals then come about one every ``1 / n`` of a request, as from
independent clients. Paced by tokens, not seconds, so it needs no step time known in advance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from benchmarks.loadgen.spec import LoadSpec, RequestRecord
from benchmarks.loadgen.sse import StreamState

Send = Callable[[int, "str | None", float, "StreamState | None"], Awaitable[RequestRecord]]


def tokens_of(state: StreamState) -> int:
    """Output tokens a stream has produced so far (per-chunk usage, else content chunks)."""
    return max(state.tokens_seen or 0, len(state.times))


class StaggeredStarts:
    """The start gate of ``workers`` closed-loop workers (see the module doc)."""

    def __init__(self, workers: int, output_len: int, endpoint: str = "completions", poll_s: float = 0.002) -> None:
        self.tokens_per_turn = output_len / max(1, workers)
        self.poll_s = poll_s
        self.pacer = StreamState(endpoint)  # worker 0's first request fills it
        self._paced_done = asyncio.Event()

    def turn_reached(self, worker: int) -> bool:
        return self._paced_done.is_set() or tokens_of(self.pacer) >= worker * self.tokens_per_turn

    def pacer_done(self) -> None:
        """Worker 0's first request ended (every worker may start)."""
        self._paced_done.set()

    async def wait_turn(self, worker: int) -> None:
        """Returns when ``worker`` may send its first request."""
        while not self.turn_reached(worker):
            try:
                await asyncio.wait_for(self._paced_done.wait(), self.poll_s)
            except TimeoutError:
                pass


async def run_workers(spec: LoadSpec, models: list[str | None], send: Send,
                      on_record: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """The closed loop: ``spec.concurrency`` workers take the requests of ``models`` in turn
    (``send(index, adapter, t_phase, state)``; ``state``: a ``StreamState`` to fill, or None for a
    fresh one), started together or, with ``spec.staggered_starts``, through ``StaggeredStarts``.
    Returns the records in index order and the wall time from the phase's start to the last end."""
    jobs = iter(enumerate(models))
    records: list[RequestRecord] = []
    workers = min(spec.concurrency, len(models))
    gate = StaggeredStarts(workers, spec.output_len, spec.endpoint) if spec.staggered_starts and workers > 1 else None
    t0 = time.perf_counter()

    async def worker(k: int) -> None:
        if gate is not None and k:
            await gate.wait_turn(k)
        first = True
        for index, adapter in jobs:
            paced = gate is not None and k == 0 and first
            try:
                record = await send(index, adapter, t0, gate.pacer if paced else None)
            finally:
                if paced:
                    gate.pacer_done()
            first = False
            records.append(record)
            if on_record is not None:
                on_record(record)

    await asyncio.gather(*(worker(k) for k in range(workers)))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0
