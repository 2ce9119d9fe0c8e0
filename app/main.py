"""The Serve application: ``import_path: app.main:build_app`` with ``args`` = ``AppConfig``."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from app.config import ENGINE, SERVER, AppConfig
from app.engine.server import EngineServer
from app.gateway.ingress import Gateway

ADAPTER_AFFINITY_ROUTER = {
    "request_router_class": "app.routing.router:AdapterAffinityRouter",
    "request_routing_stats_period_s": 1.0,
    "request_routing_stats_timeout_s": 5.0,
}
# A replica the autoscaler removes finishes its streams first (Serve's default, 20 s, cuts long ones).
ENGINE_SHUTDOWN_GRACE_S = 600.0


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validates ``args`` against ``AppConfig`` and binds the gateway to the engine deployment (or,
    ``topology: colocated``, deploys both as one: ``app.colocated.server``)."""
    cfg = AppConfig.model_validate(args or {})
    config = cfg.model_dump(mode="json")
    engine_options = cfg.engine_deployment.serve_options()
    engine_options.setdefault("graceful_shutdown_timeout_s", ENGINE_SHUTDOWN_GRACE_S)
    if cfg.topology == "colocated":  # the ingress: the proxy (HAProxy) balances its replicas itself
        from app.colocated.server import ColocatedServer

        return serve.deployment(ColocatedServer, name=SERVER).options(**engine_options).bind(config)
    engine_options.setdefault("request_router_config", ADAPTER_AFFINITY_ROUTER)
    engine = serve.deployment(EngineServer, name=ENGINE).options(**engine_options)
    gateway = Gateway.options(**cfg.gateway_deployment.serve_options())
    return gateway.bind(engine.bind(config), config)
