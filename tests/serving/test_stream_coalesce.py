"""``app.stream_coalesce``: the first item at once, what is ready later travels together, every
byte in order, errors after the text before them, closing closes the source. No timing asserted."""

from __future__ import annotations

import asyncio

import pytest

from app.stream_coalesce import coalesced
from tests.helpers.aio import asynctest


class Feed:
    """An async source whose items are released by the test, one ``put`` at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, item) -> None:
        self.queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@asynctest
async def test_first_item_at_once_then_what_is_ready_travels_together():
    feed = Feed()
    out = coalesced(feed)
    feed.put("data: 1\n\n")
    assert await out.__anext__() == "data: 1\n\n"  # alone: nothing else was ready
    for i in (2, 3, 4):  # ready while the consumer was busy with the first
        feed.put(f"data: {i}\n\n")
    await _settle()
    assert await out.__anext__() == "data: 2\n\ndata: 3\n\ndata: 4\n\n"
    feed.put("data: [DONE]\n\n")
    feed.put(StopAsyncIteration)
    assert [x async for x in out] == ["data: [DONE]\n\n"]


@asynctest
async def test_every_byte_in_order_whatever_the_timing(seed):
    import random

    rng = random.Random(seed)
    events = [f"data: {{\"i\": {i}}}\n\n" for i in range(200)] + ["data: [DONE]\n\n"]

    async def source():
        for e in events:
            if rng.random() < 0.3:
                await asyncio.sleep(0)
            yield e

    got = []
    async for item in coalesced(source()):
        got.append(item)
        if rng.random() < 0.5:
            await asyncio.sleep(0)
    assert "".join(got) == "".join(events)
    assert all(item.endswith("\n\n") for item in got)  # whole events only


@asynctest
async def test_non_string_items_are_never_joined_and_errors_come_after_the_text_before_them():
    feed = Feed()
    out = coalesced(feed)
    feed.put("data: a\n\n")
    assert await out.__anext__() == "data: a\n\n"
    feed.put("data: b\n\n")
    feed.put({"status": 500, "body": {}})
    feed.put("data: c\n\n")
    feed.put(RuntimeError("engine died"))
    await _settle()
    assert await out.__anext__() == "data: b\n\n"
    assert await out.__anext__() == {"status": 500, "body": {}}
    assert await out.__anext__() == "data: c\n\n"
    with pytest.raises(RuntimeError, match="engine died"):
        await out.__anext__()


@asynctest
async def test_closing_the_stream_closes_the_source():
    feed = Feed()
    out = coalesced(feed)
    feed.put("data: a\n\n")
    assert await out.__anext__() == "data: a\n\n"
    await out.aclose()  # the client left while the source was waiting for a token
    assert feed.closed
