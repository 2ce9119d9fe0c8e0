"""Operator admin HTTP API (``/admin/...``), an ``APIRouter`` the gateway includes.

Every route needs an operator key (``Authorization: Bearer <key>`` of a tenant with
``operator: true``): 401 without a valid key, 403 for a non-operator. Routes reach the serving
state bound with ``bind_gateway(gateway)``, which must provide ``tenants`` (authenticate),
``store`` (an ``AdapterStore``), ``catalog`` (``invalidate``), ``cfg`` (``AppConfig``) and, for
pin/unpin/residency, ``engine`` (the engine deployment handle with ``pin_adapter(manifest_dict)``,
``unpin_adapter(adapter_id)`` and ``residency()``).

- ``POST   /admin/adapters``              multipart: ``adapter_id``, ``tenant``, files
  ``adapter_config.json`` + ``adapter_model.safetensors``; validates and publishes a new version
- ``GET    /admin/adapters``              latest manifest of every adapter
- ``GET    /admin/adapters/{id}``         latest manifest and the list of versions
- ``DELETE /admin/adapters/{id}``         delete every version (404 afterwards)
- ``POST   /admin/adapters/{id}/pin``     keep resident on the engine replica that answers
- ``POST   /admin/adapters/{id}/unpin``
- ``GET    /admin/residency``             slot table and disk cache of the engine replica that answers
- ``GET    /admin/metrics/targets``       every node's metrics export address (Prometheus HTTP service discovery)
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from adapters_registry.errors import AdapterInvalid
from adapters_registry.manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo
from adapters_registry.validation import ValidationLimits
from app.errors import Forbidden, LoraplexError, error_response
from app.observability.targets import scrape_targets

router = APIRouter(prefix="/admin", tags=["admin"])
UPLOAD_NAMES = (CONFIG_NAME, WEIGHTS_NAME)
CHUNK = 4 * 2**20


class NotImplementedByEngine(LoraplexError):
    http_status = 501
    error_type = "not_implemented"


_bound: dict[str, Any] = {}


def bind_gateway(gateway: Any) -> None:
    """Called by the gateway replica at start: the serving state the admin routes act on.

    (A module-level binding: Serve freezes the FastAPI app when the ingress class is decorated,
    so the replica cannot reach the frozen app's ``state`` from its constructor.)
    """
    _bound["gateway"] = gateway


def _errors_as_responses(route):
    """Every admin route answers errors through ``app.errors`` (status, message, Retry-After)."""

    @functools.wraps(route)  # FastAPI reads the wrapped signature for its parameters
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except Exception as exc:
            return error_response(exc)

    return wrapper


def _gateway(request: Request):
    gw = _bound.get("gateway") or getattr(request.app.state, "gateway", None)
    if gw is None:
        raise LoraplexError("admin API used before the gateway started")
    tenant = gw.tenants.authenticate(request.headers.get("authorization"))
    if not tenant.operator:
        raise Forbidden(f"tenant {tenant.name!r} is not an operator; the admin API needs an operator key")
    return gw


def _engine_method(gw, name: str):
    method = getattr(getattr(gw, "engine", None), name, None)
    if method is None:
        raise NotImplementedByEngine(f"the engine deployment does not offer {name}()")
    return method


async def _save_uploads(files: list[UploadFile], dest: Path, limit: int) -> None:
    total = 0
    for f in files:
        name = Path(f.filename or "").name
        if name not in UPLOAD_NAMES:
            raise AdapterInvalid(
                f"uploaded file {f.filename!r} refused: send exactly {CONFIG_NAME} and {WEIGHTS_NAME} "
                "(pickle formats such as .bin/.pt are never accepted)"
            )
        with open(dest / name, "wb") as out:
            while chunk := await f.read(CHUNK):
                total += len(chunk)
                if total > limit:
                    raise AdapterInvalid(f"upload exceeds the adapter size limit of {limit} bytes")
                await asyncio.to_thread(out.write, chunk)


@router.post("/adapters")
@_errors_as_responses
async def push_adapter(
    request: Request,
    adapter_id: str = Form(..., description="Adapter id (A-Z a-z 0-9 _ . -)."),
    tenant: str = Form(..., description="Owner tenant."),
    files: list[UploadFile] = Form(..., description=f"{CONFIG_NAME} and {WEIGHTS_NAME}."),
) -> Response:
    gw = _gateway(request)
    limits = ValidationLimits()
    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="loraplex-upload-"))
    try:
        await _save_uploads(files, work, limits.max_total_bytes)
        ecfg = gw.cfg.engine
        base = await asyncio.to_thread(BaseModelInfo.from_model, ecfg.resolved_model())
        manifest = await asyncio.to_thread(
            gw.store.publish, work, adapter_id, tenant, base, ecfg.max_lora_rank, limits
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    gw.catalog.invalidate(adapter_id)
    return JSONResponse(manifest.model_dump(mode="json"), status_code=201)


@router.get("/adapters")
@_errors_as_responses
async def list_adapters(request: Request) -> Response:
    gw = _gateway(request)
    manifests = await asyncio.to_thread(gw.store.list)
    return JSONResponse({"adapters": [m.model_dump(mode="json") for m in manifests]})


@router.get("/adapters/{adapter_id}")
@_errors_as_responses
async def get_adapter(adapter_id: str, request: Request) -> Response:
    gw = _gateway(request)
    manifest = await asyncio.to_thread(gw.store.get, adapter_id)
    versions = await asyncio.to_thread(gw.store.versions, adapter_id)
    return JSONResponse({"manifest": manifest.model_dump(mode="json"), "versions": versions})


@router.delete("/adapters/{adapter_id}")
@_errors_as_responses
async def delete_adapter(adapter_id: str, request: Request) -> Response:
    gw = _gateway(request)
    versions = await asyncio.to_thread(gw.store.delete, adapter_id)
    gw.catalog.invalidate(adapter_id)
    return JSONResponse({"deleted": adapter_id, "versions": versions})


@router.post("/adapters/{adapter_id}/pin")
@_errors_as_responses
async def pin_adapter(adapter_id: str, request: Request) -> Response:
    gw = _gateway(request)
    manifest = await asyncio.to_thread(gw.store.get, adapter_id)
    result: Any = await _engine_method(gw, "pin_adapter").remote(manifest.model_dump(mode="json"))
    return JSONResponse({"pinned": manifest.lora_name, "engine": result})


@router.post("/adapters/{adapter_id}/unpin")
@_errors_as_responses
async def unpin_adapter(adapter_id: str, request: Request) -> Response:
    gw = _gateway(request)
    result: Any = await _engine_method(gw, "unpin_adapter").remote(adapter_id)
    return JSONResponse({"unpinned": adapter_id, "engine": result})


@router.get("/residency")
@_errors_as_responses
async def residency(request: Request) -> Response:
    gw = _gateway(request)
    return JSONResponse(await _engine_method(gw, "residency").remote())



@router.get("/metrics/targets")
@_errors_as_responses
async def metrics_targets(request: Request) -> Response:
    _gateway(request)
    return JSONResponse([g.model_dump() for g in await scrape_targets()])
