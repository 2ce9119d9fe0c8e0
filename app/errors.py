"""Typed errors of the serving path and their one mapping to HTTP responses (OpenAI error shape).

Every error the gateway returns goes through ``error_response``: registry errors carry their own
``http_status``; vLLM's ``ErrorResponse`` objects are passed through with their code. Every error
body names the request's id (``error.request_id``, from ``app.request_ids.current()``), FastAPI's
own errors (unknown route, wrong method) included once ``install_handlers`` ran on the app.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from app import request_ids


class LoraplexError(Exception):
    """Base class: ``http_status`` and an OpenAI-style ``error_type``; the message says what to fix."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, retry_after_s: float | None = None, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.reason = reason or self.error_type  # one word for metrics and logs (e.g. admission's cause)


class Unauthorized(LoraplexError):
    http_status = 401
    error_type = "authentication_error"


class Forbidden(LoraplexError):
    http_status = 403
    error_type = "permission_error"


class NotFound(LoraplexError):
    http_status = 404
    error_type = "not_found_error"


class AdapterNotVisible(NotFound):
    """An adapter the caller may not use, or that does not exist: one answer for both, so an
    adapter's existence does not leak to other tenants (the message depends on the id asked only)."""

    def __init__(self, adapter_id: str):
        super().__init__(f"The model {adapter_id!r} does not exist or you do not have access to it; "
                         "GET /v1/models lists the models you may call")


class BadRequest(LoraplexError):
    http_status = 400
    error_type = "invalid_request_error"


class RateLimited(LoraplexError):
    http_status = 429
    error_type = "rate_limit_error"


class Overloaded(LoraplexError):
    http_status = 503
    error_type = "overloaded_error"


class NotReady(LoraplexError):
    http_status = 503
    error_type = "not_ready"


class EngineUnavailable(LoraplexError):
    """The engine of the replica that took the request died; Serve replaces the replica."""

    http_status = 503
    error_type = "overloaded_error"


class PayloadTooLarge(LoraplexError):
    http_status = 413
    error_type = "invalid_request_error"


class HeadersTooLarge(LoraplexError):
    http_status = 431
    error_type = "invalid_request_error"


def error_body(status: int, message: str, error_type: str) -> dict[str, Any]:
    """The OpenAI error JSON: ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "code": status}}


def describe(exc: Exception) -> tuple[int, dict[str, Any], float | None]:
    """``(status, OpenAI error body, retry_after_s)`` of any exception of the serving path.

    Exceptions with ``http_status`` (ours, the registry's) keep their status and message; anything
    else is a 500 whose message names the exception type.
    """
    status = int(getattr(exc, "http_status", 500))
    error_type = getattr(exc, "error_type", None) or _type_for_status(status)
    message = getattr(exc, "message", None) or str(exc) or exc.__class__.__name__
    if not hasattr(exc, "http_status"):
        message = f"internal error: {exc.__class__.__name__}: {message}"
    return status, error_body(status, message, error_type), getattr(exc, "retry_after_s", None)


def with_request_id(body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
    """``body`` with ``error.request_id`` set to ``request_id`` (default: the current request's;
    a copy; unchanged when there is no id or no ``error`` object)."""
    request_id = request_id or request_ids.current()
    error = body.get("error")
    if request_id is None or not isinstance(error, dict) or "request_id" in error:
        return body
    return {**body, "error": {**error, "request_id": request_id}}


def json_error(status: int, body: dict[str, Any], retry_after_s: float | None = None, headers: dict | None = None) -> JSONResponse:
    """The error response, with ``Retry-After`` (whole seconds, at least 1) when retrying can help."""
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(round(retry_after_s))))
    return JSONResponse(with_request_id(body), status_code=status, headers=headers)


def error_response(exc: Exception) -> JSONResponse:
    """Maps any exception of the serving path to a JSON error response."""
    return json_error(*describe(exc))


def install_handlers(app) -> None:
    """FastAPI's own errors (unknown route, wrong method, invalid path parameters) in the same
    shape as every other error."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def http_error(request, exc: HTTPException) -> JSONResponse:
        status = exc.status_code
        return json_error(status, error_body(status, str(exc.detail), _type_for_status(status)),
                          headers=getattr(exc, "headers", None))

    async def invalid(request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]]  # no input values
        return json_error(422, error_body(422, "invalid request: " + "; ".join(parts), "invalid_request_error"))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)


def _type_for_status(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        503: "overloaded_error",
    }.get(status, "internal_error")
