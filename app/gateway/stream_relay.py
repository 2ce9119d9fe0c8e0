"""The relay of one engine stream to its client, and the release of what the stream holds.

A streamed request holds its admission slot (and, through the engine's generator, the adapter's
pin on its replica) until the stream ends. It can end three ways: the engine finishes; the client
goes away while chunks flow; the client goes away before the body starts. In the last case
Starlette never iterates the body (Ray Serve cancels the ASGI call on a disconnect, Starlette
cancels ``stream_response`` when it hears ``http.disconnect``), so a ``finally`` inside the body
generator never runs. ``RelayResponse`` therefore releases in the response's own ``__call__``,
which runs in every case, and ``StreamRelay.close`` is idempotent: the engine's generator is
cancelled if it had not ended (vLLM aborts the request, the slot table unpins the adapter), the
admission slot is given back, the outcome recorded once.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from fastapi.responses import StreamingResponse

from app.errors import EngineUnavailable, describe, with_request_id
from app.observability.gateway import CLIENT_CLOSED, GatewayRequest
from app.stream_coalesce import coalesced


class StreamRelay:
    def __init__(self, gen: Any, admitted: AsyncExitStack, obs: GatewayRequest) -> None:
        self._gen = gen  # Serve's DeploymentResponseGenerator, past its head item
        self._admitted = admitted
        self._obs = obs
        self.status = CLIENT_CLOSED  # unless the stream ends first
        self._ended = False
        self.closed = False

    async def chunks(self):
        """The SSE body: the engine's chunks; an error item after the stream started becomes an
        error event and ``[DONE]``, and so does the loss of the engine replica mid-stream. Chunks
        ready while a write is in flight travel as one write (``app.stream_coalesce``)."""
        items = coalesced(self._gen)
        try:
            try:
                async for item in items:
                    if isinstance(item, dict):
                        self.status = item["status"]
                        yield self._event(item["body"])
                        yield "data: [DONE]\n\n"
                        return
                    yield item
            except Exception as exc:  # the replica's actor died (its process killed, its node lost)
                self.status, body, _ = describe(EngineUnavailable(
                    f"the engine replica serving this stream failed ({type(exc).__name__}); retry the request"))
                yield self._event(body)
                yield "data: [DONE]\n\n"
                return
            self.status = 200
        finally:
            await items.aclose()
            self._ended = self.status != CLIENT_CLOSED
            await self.close()

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(with_request_id(body, self._obs.request_id))}\n\n"

    async def close(self) -> None:
        """Releases everything the stream holds (first call only)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self._ended:
                self._gen.cancel()  # the engine replica's generator is cancelled: vLLM aborts
        finally:
            await self._admitted.aclose()
            self._obs.finish(self.status)


class RelayResponse(StreamingResponse):
    """A ``StreamingResponse`` of a ``StreamRelay`` that closes it however the response ends."""

    def __init__(self, relay: StreamRelay, headers: dict[str, str]) -> None:
        super().__init__(relay.chunks(), media_type="text/event-stream", headers=headers)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()
            await self.body_iterator.aclose()  # a body started and abandoned runs its finally now
