"""Adaptive coalescing of a stream of SSE strings: no fixed delay, fewer sends.

``coalesced(source)`` yields the first item as soon as it arrives; while the consumer is busy
with an item (its send in flight: a Ray stream item, an ASGI write), a pump task keeps reading
``source``, and everything that is ready when the consumer asks again travels as one string.
So an idle stream is relayed token by token at once, and a stream whose consumer lags sends
fewer, larger items instead of queueing one send per token (ray.serve.llm's alternative is a
fixed 50 ms batching interval). Joining whole ``data: ...\\n\\n`` events keeps the bytes
exactly those of the source, in order.

Items that are not strings (the protocol's error dicts) are never joined: the text ready before
one is yielded first, then the item itself. Closing the coalesced generator (the client left)
cancels the pump and closes ``source`` at once, so vLLM aborts the request as it would if
``source`` itself were closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

_END = object()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def coalesced(source: AsyncIterator[Any], max_chars: int = 1 << 20) -> AsyncIterator[Any]:
    """``source``'s items, strings ready together joined (each joined item at most about
    ``max_chars`` long); other items passed through alone, order kept; ``source``'s exception
    re-raised after the items before it."""
    ready: deque[Any] = deque()
    wake = asyncio.Event()

    async def pump() -> None:
        try:
            async for item in source:
                ready.append(item)
                wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            ready.append(_Failed(exc))
        else:
            ready.append(_END)
        wake.set()

    task = asyncio.ensure_future(pump())
    try:
        while True:
            if not ready:
                wake.clear()
                await wake.wait()
            head = ready.popleft()
            if head is _END:
                return
            if isinstance(head, _Failed):
                raise head.exc
            if not isinstance(head, str):
                yield head
                continue
            parts, size = [head], len(head)
            while ready and isinstance(ready[0], str) and size < max_chars:
                nxt = ready.popleft()
                parts.append(nxt)
                size += len(nxt)
            yield parts[0] if len(parts) == 1 else "".join(parts)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # the pump's own end; a cancellation of ours still propagates
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
