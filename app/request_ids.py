"""Request ids: the client's ``x-request-id`` when it is a usable id, else a new one.

Ray Serve's proxy reads ``x-request-id`` (making one when absent), propagates it to every
deployment the request reaches, and returns it as the response's ``x-request-id``. The gateway
reads the same header (``accept``), so logs, error bodies, the engine replica and vLLM see the id
the client sees. An id of more than ``MAX_LEN`` characters or with characters outside printable
ASCII (space excluded) is replaced by a new one (the proxy still echoes the client's). The
current request's id is a context variable (``bind`` / ``current``).
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar, Token

HEADER = "x-request-id"
MAX_LEN = 128
_USABLE = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_LEN)
_current: ContextVar[str | None] = ContextVar("loraplex_request_id", default=None)


def new_id() -> str:
    return uuid.uuid4().hex


def accept(value: str | None) -> str:
    """``value`` if it is a usable id, else a new one."""
    return value if value is not None and _USABLE.fullmatch(value) else new_id()


def bind(request_id: str) -> Token:
    """Makes ``request_id`` the current one (undo with ``unbind(token)``)."""
    return _current.set(request_id)


def unbind(token: Token) -> None:
    _current.reset(token)


def current() -> str | None:
    """The id of the request being handled in this context, or None."""
    return _current.get()
