"""Gateway deployment: the OpenAI-compatible HTTP ingress with tenancy.

Per request: authenticate the bearer key (401), resolve the adapter from the route or ``model``
(404 when it is unknown or not this tenant's: the two answers are the same), admit against the
tenant's limits (429), then dispatch to the engine deployment through its Serve handle, with the
tenant's fair-share ticket, and relay the answer (JSON or SSE). All errors leave through
``app.errors``; every answer names the gateway replica (``x-loraplex-gateway``). Each request is
measured and logged by ``app.observability.gateway`` (outcome, duration, queue time, admission
rejections) under its request id, which the engine receives in ``RequestMeta``. The public port
serves no metrics (see ``app.observability``).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from adapters_registry.errors import RegistryError
from app import request_ids
from app.config import GATEWAY, AppConfig
from app.errors import (
    AdapterNotVisible,
    BadRequest,
    NotReady,
    Overloaded,
    RateLimited,
    error_response,
    install_handlers,
    json_error,
)
from app.gateway import admin_routes, request_limits
from app.gateway.admission import build_admission
from app.gateway.catalog import AdapterCatalog
from app.gateway.openai_bodies import (
    ChatCompletionBody,
    CompletionBody,
    GatewayFields,
    openapi_body,
)
from app.gateway.request_context import RequestIdMiddleware
from app.gateway.stream_relay import RelayResponse, StreamRelay
from app.gateway.tenants import Tenant, TenantDirectory
from app.observability.gateway import GatewayRecorder, GatewayRequest
from app.request_meta import RequestMeta
from app.vtc import weight_of

api = FastAPI(title="loraplex", description="Multi-tenant LoRA serving for MoE LLMs")
api.include_router(admin_routes.router)
api.add_middleware(RequestIdMiddleware)
install_handlers(api)
READY_TIMEOUT_S = 30.0
DEFAULT_MAX_TOKENS = 256
REPLICA_HEADER = "x-loraplex-replica"  # which engine replica answered (operators, routing tests)
GATEWAY_HEADER = "x-loraplex-gateway"  # which gateway replica answered
# Helpers sit above the ingress class: @serve.ingress freezes the FastAPI app (and the globals its
# routes see) when the class is decorated.


def _prompt_estimate(prompt: Any) -> int:
    """Tokens of a prompt: token ids count one each; text and anything else ~4 characters a token."""
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return len(prompt)
        if all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    return len(prompt) // 4 if isinstance(prompt, str) else len(json.dumps(prompt)) // 4


def _estimate_tokens(body: dict[str, Any], fields: GatewayFields) -> int:
    """Rough upper estimate for budgets: the prompt's tokens (``_prompt_estimate``), plus
    max_tokens for each of the ``n`` completions."""
    prompt = body.get("messages") if "messages" in body else body.get("prompt")
    max_tokens = fields.max_completion_tokens or fields.max_tokens or DEFAULT_MAX_TOKENS
    return _prompt_estimate(prompt) + max(1, fields.n or 1) * max(0, max_tokens)


def _replica_identity() -> tuple[str, str | None]:
    """``(this replica's id, its quota ledger's name)``; outside Serve: a pid and no shared ledger."""
    try:
        ctx = serve.get_replica_context()
        return ctx.replica_id.unique_id, f"quotas-{ctx.app_name}"
    except Exception:
        import os

        return f"pid-{os.getpid()}", None


def _engine_response(out: dict[str, Any]) -> Response:
    """An engine result (see ``app.engine.server``'s protocol) as the HTTP response."""
    headers = {REPLICA_HEADER: out["replica"]}
    if out["status"] == 200:
        return JSONResponse(out["body"], headers=headers)
    return json_error(out["status"], out["body"], out.get("retry_after_s"), headers)


@serve.deployment(name=GATEWAY)
@serve.ingress(api)
class Gateway:
    def __init__(self, engine: DeploymentHandle, config: dict[str, Any]):
        self.cfg = AppConfig.model_validate(config)
        self.engine = engine
        self.base_name = self.cfg.engine.served_model_name
        self.tenants = TenantDirectory(self.cfg.resolved_tenants_file())
        self.store = self.cfg.open_store()
        self.catalog = AdapterCatalog(self.store)
        self.replica, ledger_name = _replica_identity()
        self.admission = build_admission(self.cfg, self.replica, ledger_name)
        self.recorder = GatewayRecorder(self.cfg.observability)
        admin_routes.bind_gateway(self)

    def __del__(self) -> None:
        catalog = getattr(self, "catalog", None)
        if catalog is not None:
            catalog.close()

    # ---- routes -------------------------------------------------------------------------------
    @api.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    async def chat(self, request: Request) -> Response:
        return await self._handle(request, "chat", None)

    @api.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion", None)

    @api.post("/v1/adapters/{adapter_id}/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    async def adapter_chat(self, adapter_id: str, request: Request) -> Response:
        return await self._handle(request, "chat", adapter_id)

    @api.post("/v1/adapters/{adapter_id}/completions", openapi_extra=openapi_body(CompletionBody))
    async def adapter_completions(self, adapter_id: str, request: Request) -> Response:
        return await self._handle(request, "completion", adapter_id)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
            manifests = await self.catalog.list()
        except Exception as exc:
            return error_response(exc)
        data = [{"id": self.base_name, "object": "model", "created": 0, "owned_by": "loraplex"}]
        for m in sorted(manifests, key=lambda m: m.adapter_id):
            if tenant.may_use(m.adapter_id, m.owner_tenant):
                data.append(
                    {"id": m.adapter_id, "object": "model", "created": int(m.created_at.timestamp()),
                     "owned_by": m.owner_tenant, "parent": self.base_name, "version": m.version}
                )
        return JSONResponse({"object": "list", "data": data})

    @api.get("/healthz")
    async def healthz(self) -> Response:
        return JSONResponse({"status": "ok"})

    @api.get("/readyz")
    async def readyz(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.ready.remote(), READY_TIMEOUT_S)
        except Exception as exc:
            return error_response(NotReady(f"engine not ready: {type(exc).__name__}: {exc}"))
        return JSONResponse({"status": "ready"})

    # ---- request path -------------------------------------------------------------------------
    async def _handle(self, request: Request, kind: str, route_adapter: str | None) -> Response:
        response = await self._answer(request, kind, route_adapter)
        response.headers[GATEWAY_HEADER] = self.replica
        return response

    async def _answer(self, request: Request, kind: str, route_adapter: str | None) -> Response:
        obs = self.recorder.request(kind, request_ids.current() or request_ids.new_id())
        status, reason = 500, None
        try:
            request_limits.check_headers(request, self.cfg.max_header_bytes)
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
            obs.tenant = tenant.name
            body = await request_limits.json_object(request, self.cfg.max_request_bytes)
            fields = GatewayFields.of(body)
            adapter_id = route_adapter or fields.model
            if not adapter_id:
                raise BadRequest(f"missing 'model': use '{self.base_name}' or an adapter id")
            manifest = None if adapter_id == self.base_name else await self._authorize(tenant, adapter_id)
            obs.adapter = adapter_id
            body.pop("model", None)
            meta = RequestMeta(request_id=obs.request_id, tenant=tenant.name, adapter=adapter_id).model_dump()
            engine = self.engine.options(multiplexed_model_id=adapter_id if manifest else "")
            estimate, fair = _estimate_tokens(body, fields), self.tenants.fair_share
            share = ({"tenant": tenant.name, "weight": weight_of(tenant.priority), "estimated_tokens": estimate}
                     if fair else None)  # an app.engine.fair_share.TenantShare
            if fields.stream:
                # The admission slot is held until the stream ends, not until the response starts.
                obs.stream = True
                admitted = AsyncExitStack()
                await admitted.enter_async_context(self.admission.admit(tenant, estimate, fair))
                obs.dispatched()
                response = await self._stream(engine, kind, body, manifest, meta, admitted, obs, share)
            else:
                async with self.admission.admit(tenant, estimate, fair):
                    obs.dispatched()
                    out = await engine.generate.remote(kind, body, manifest, meta, share)
                    obs.replica = out["replica"]
                    response = _engine_response(out)
            status = response.status_code
            return response
        except Exception as exc:
            status, reason = getattr(exc, "http_status", 500), getattr(exc, "reason", type(exc).__name__)
            if isinstance(exc, (RateLimited, Overloaded)):
                obs.rejected(reason)
            return error_response(exc)
        finally:
            if not (obs.stream and status == 200):  # a stream that started finishes in its relay
                obs.finish(status, reason)

    async def _authorize(self, tenant: Tenant, adapter_id: str) -> dict:
        """Latest manifest (as a dict) if the tenant may call the adapter; else ``AdapterNotVisible``
        (404), the same for an adapter of another tenant as for one that does not exist."""
        try:
            manifest = await self.catalog.get(adapter_id)
        except RegistryError as exc:
            if exc.http_status == 404:
                raise AdapterNotVisible(adapter_id) from None
            raise
        if not tenant.may_use(manifest.adapter_id, manifest.owner_tenant):
            raise AdapterNotVisible(adapter_id)
        return self.catalog.dump(manifest)

    async def _stream(
        self, engine: DeploymentHandle, kind: str, body: dict, manifest: dict | None, meta: dict,
        admitted: AsyncExitStack, obs: GatewayRequest, share: dict | None = None,
    ) -> Response:
        """Relays the engine's SSE stream (``app.gateway.stream_relay``): ``admitted`` (the
        admission slot) closes and ``obs`` records the outcome when it ends, whichever way."""
        try:
            gen = engine.options(stream=True).generate_stream.remote(kind, body, manifest, meta, share)
            head = await gen.__anext__()
        except BaseException:
            if "gen" in locals():
                gen.cancel()  # the client went away while the head was awaited: vLLM aborts
            await admitted.aclose()
            raise
        obs.replica = head["replica"]
        if head["status"] != 200:
            await admitted.aclose()
            return _engine_response(head)
        return RelayResponse(StreamRelay(gen, admitted, obs), {REPLICA_HEADER: head["replica"]})
