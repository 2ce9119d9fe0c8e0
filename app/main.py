"""The Serve application: ``import_path: app.main:build_app`` with ``args`` = ``AppConfig``."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from app.config import AppConfig
from app.engine import EngineServer
from app.gateway import Gateway


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validates ``args`` against ``AppConfig`` and binds the gateway to the engine deployment."""
    cfg = AppConfig.model_validate(args or {})
    config = cfg.model_dump(mode="json")
    engine = serve.deployment(EngineServer, name="Engine").options(**cfg.engine_deployment.serve_options())
    gateway = Gateway.options(**cfg.gateway_deployment.serve_options())
    return gateway.bind(engine.bind(config), config)
