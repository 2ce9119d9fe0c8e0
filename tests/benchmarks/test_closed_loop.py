"""The closed loop's workers: started together, or spread over one request by its tokens."""

from __future__ import annotations

import asyncio

from benchmarks.loadgen.closed_loop import run_workers, tokens_of
from benchmarks.loadgen.spec import LoadSpec, RequestRecord, TargetSpec
from benchmarks.loadgen.sse import StreamState
from tests.helpers.aio import asynctest

OUTPUT = 8


def spec(concurrency: int, staggered: bool) -> LoadSpec:
    return LoadSpec(target=TargetSpec(name="fake", base_url="http://127.0.0.1:9"), input_len=4,
                    output_len=OUTPUT, concurrency=concurrency, num_requests=8, vocab_size=100,
                    staggered_starts=staggered)


class FakeServer:
    """Streams ``OUTPUT`` tokens, one per ms, into the state it is given; notes at every send how
    many tokens the paced (first) request had produced."""

    def __init__(self) -> None:
        self.pacer: StreamState | None = None
        self.pacer_tokens_at_send: dict[int, int] = {}
        self.produced = 0  # tokens of every request so far
        self.produced_at_send: dict[int, int] = {}

    async def send(self, index: int, adapter, t0: float, state: StreamState | None) -> RequestRecord:
        if state is not None:
            self.pacer = state
        self.pacer_tokens_at_send[index] = tokens_of(self.pacer) if self.pacer is not None else 0
        self.produced_at_send[index] = self.produced
        own = state if state is not None else StreamState("completions")
        for i in range(OUTPUT):
            await asyncio.sleep(0.001)
            own.tokens_seen = i + 1
            self.produced += 1
        return RequestRecord(index=index, adapter=adapter, model="m", start_s=0.0, status=200, ok=True,
                             expected_output_tokens=OUTPUT)


@asynctest
async def test_staggered_workers_start_as_the_first_request_produces_its_share_of_tokens():
    server = FakeServer()
    records, _ = await run_workers(spec(4, True), [None] * 8, server.send)
    assert [r.index for r in records] == list(range(8))
    # worker k's first request (index k) went once the first had produced k * 8/4 tokens
    assert [server.pacer_tokens_at_send[k] >= 2 * k for k in range(4)] == [True] * 4
    assert server.pacer_tokens_at_send[1] < server.pacer_tokens_at_send[2] < server.pacer_tokens_at_send[3]
    assert server.produced_at_send[1] > 0  # not a wave


@asynctest
async def test_workers_start_together_by_default():
    server = FakeServer()
    records, _ = await run_workers(spec(4, False), [None] * 8, server.send)
    assert len(records) == 8 and server.pacer is None  # nothing paced
    assert [server.produced_at_send[k] for k in range(4)] == [0, 0, 0, 0]  # a wave of 4 at once
