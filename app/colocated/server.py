"""Colocated topology: the gateway and its engine in one replica (``topology: colocated``).

The split topology (``app.main``) runs the gateway and the engine as two deployments: every request
and every streamed chunk crosses a Ray handle between two processes. Here one replica owns both:
the HTTP ingress (tenants, admission, fair share, the same routes and error mapping as
``app.gateway.ingress``) calls its own ``EngineServer`` through ``LocalHandle``, as vLLM's own
server calls its engine. Serve's proxy (or HAProxy) reaches the replica directly.

Trade-off: with several replicas the proxy picks one without reading the body (HAProxy by its own
balancing; Serve refuses a custom request router on an ingress behind HAProxy), so requests are
not routed by adapter. The split topology routes every request by its adapter: use it for
several engine replicas, this one for one replica per application (the embedded default, one
GPU).
"""

from __future__ import annotations

from typing import Any

from app.colocated.handle import LocalHandle
from app.engine.server import EngineServer
from app.gateway.ingress import Gateway


class ColocatedServer(Gateway.func_or_class):
    """Gateway routes over an in-process engine. Serve's replica hooks (health, routing stats) are
    the engine's."""

    async def __init__(self, config: dict[str, Any]) -> None:
        engine = EngineServer.__new__(EngineServer)
        await engine.__init__(config)
        self.local_engine = engine
        await super().__init__(LocalHandle(engine), config)

    async def check_health(self) -> None:
        await self.local_engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.local_engine.record_routing_stats()

    async def __del__(self) -> None:
        await super().__del__()
        engine = getattr(self, "local_engine", None)
        if engine is not None:
            engine.__del__()
