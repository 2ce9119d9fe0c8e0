"""``app.colocated.handle``: an in-process object called as the gateway calls a Serve handle."""

from __future__ import annotations

import asyncio

import pytest

from app.colocated.handle import LocalHandle, LocalStream
from app.stream_coalesce import coalesced


class FakeEngine:
    """Methods of each kind the gateway calls; records what its generators' ``finally`` saw."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.calls: list[tuple] = []

    async def generate(self, kind: str, body: dict) -> dict:
        self.calls.append((kind, body))
        return {"status": 200, "body": body}

    def unpin_adapter(self, adapter_id: str) -> dict:
        return {"rows_unpinned": 1, "adapter": adapter_id}

    async def generate_stream(self, n: int, tag: str):
        try:
            yield {"status": 200}
            for i in range(n):
                await asyncio.sleep(0)
                yield f"data: {i}\n\n"
        finally:
            self.closed.append(tag)

    def _private(self) -> None:  # never reachable through the handle
        raise AssertionError


def test_methods_of_each_kind_answer_as_serve_responses_do():
    engine = FakeEngine()
    handle = LocalHandle(engine)

    async def main():
        assert handle.options(multiplexed_model_id="a").options(stream=True) is handle
        body = {"prompt": "x"}
        out = await handle.generate.remote("completion", body)
        assert out == {"status": 200, "body": body} and out["body"] is body  # by reference, not copied
        assert await handle.unpin_adapter.remote("acme") == {"rows_unpinned": 1, "adapter": "acme"}
        assert await asyncio.wait_for(handle.generate.remote("chat", {}), 1) == {"status": 200, "body": {}}
        items = [item async for item in handle.generate_stream.remote(2, "whole")]
        assert items == [{"status": 200}, "data: 0\n\n", "data: 1\n\n"] and engine.closed == ["whole"]

    asyncio.run(main())
    assert getattr(handle, "pin_adapter", None) is None  # the admin API's "does the engine offer it"
    with pytest.raises(AttributeError):
        handle._private  # noqa: B018


def test_cancel_closes_the_engine_generator_without_awaiting():
    """The relay's ``cancel()`` after the head (the client left before the body): the generator's
    ``finally`` (vLLM's abort, the adapter's unpin) runs on the loop's next turns."""
    engine = FakeEngine()

    async def main():
        stream = LocalHandle(engine).generate_stream.remote(1000, "abandoned")
        assert isinstance(stream, LocalStream)
        assert await stream.__anext__() == {"status": 200}
        stream.cancel()
        stream.cancel()  # idempotent
        for _ in range(5):
            await asyncio.sleep(0)
        assert engine.closed == ["abandoned"]
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(main())


def test_closing_the_relays_coalesced_stream_closes_the_engine_generator_mid_stream():
    """The client left mid-stream: the relay closes ``coalesced(stream)``, whose pump was reading
    the engine generator; the generator ends then, not when the stream would have."""
    engine = FakeEngine()

    async def main():
        stream = LocalHandle(engine).generate_stream.remote(1000, "mid-stream")
        assert await stream.__anext__() == {"status": 200}
        items = coalesced(stream)
        first = await items.__anext__()
        assert first.startswith("data: 0\n\n")
        await items.aclose()
        assert engine.closed == ["mid-stream"]
        stream.cancel()  # what the relay's close() does next: nothing left to close
        await stream.aclose()
        assert engine.closed == ["mid-stream"]

    asyncio.run(main())


def test_cancel_while_a_pump_is_inside_the_generator_leaves_the_close_to_the_pumps_cancellation():
    """``cancel()`` while another task awaits the generator's next item cannot close it (Python
    refuses to close a running generator): it does nothing, and cancelling that task ends it."""
    engine = FakeEngine()

    async def main():
        gate = asyncio.Event()

        async def slow():
            try:
                yield {"status": 200}
                await gate.wait()
                yield "data: late\n\n"
            finally:
                engine.closed.append("pumped")

        engine.slow = slow
        stream = LocalHandle(engine).slow.remote()
        assert await stream.__anext__() == {"status": 200}
        pump = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        stream.cancel()  # no error, no pending close failing in the background
        await asyncio.sleep(0)
        assert engine.closed == []
        pump.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pump
        assert engine.closed == ["pumped"]
        await stream.aclose()

    asyncio.run(main())
