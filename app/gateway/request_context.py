"""ASGI middleware of the gateway: binds each HTTP request's id for the request's lifetime.

The id is ``app.request_ids.accept`` of the request's ``x-request-id`` header (Serve's proxy
sets one on every request, the client's or its own), so handlers, error bodies and request logs
of the gateway see the id the response's ``x-request-id`` carries. Pure ASGI: nothing wraps the
response body, streams pass through untouched.
"""

from __future__ import annotations

from app import request_ids

_HEADER = request_ids.HEADER.encode()


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER), None)
        token = request_ids.bind(request_ids.accept(value))
        try:
            await self.app(scope, receive, send)
        finally:
            request_ids.unbind(token)
