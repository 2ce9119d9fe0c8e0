"""What a client sends, bounded and well-formed before tenancy or an engine sees it.

Headers above ``max_header_bytes`` are refused with 431, bodies above ``max_request_bytes`` with
413 (from ``Content-Length`` before reading, else while reading); a body must be one RFC 8259
JSON object (``NaN``/``Infinity`` are not JSON) of valid Unicode text (an unpaired UTF-16
surrogate, legal in a JSON escape, cannot be encoded for the tokenizer): 400 naming where.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from app.errors import BadRequest, HeadersTooLarge, PayloadTooLarge

PARSE_IN_THREAD_BYTES = 1 << 20  # larger bodies are parsed off the event loop


def check_headers(request: Request, max_bytes: int) -> None:
    size = sum(len(k) + len(v) for k, v in request.headers.raw)
    if size > max_bytes:
        raise HeadersTooLarge(f"request headers are {size} bytes, above the limit of {max_bytes}: send fewer or shorter headers")


async def read_body(request: Request, max_bytes: int) -> bytes:
    def too_large(size: str) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is {size} bytes, above the limit of {max_bytes}: send a shorter prompt")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(declared)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large(f"more than {max_bytes}")
        chunks.append(chunk)
    return b"".join(chunks)


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON value (RFC 8259); send a number")


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    where = unpaired_surrogate(body) if may_hold_surrogates(raw) else None
    if where is not None:
        raise BadRequest(f"request body has an unpaired UTF-16 surrogate in {where}: send valid Unicode text")
    return body


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether ``json.loads(raw)`` can hold a UTF-16 surrogate: only through a ``\\uD800``–
    ``\\uDFFF`` escape, or the UTF-8 bytes of one (0xED 0xA0–0xBF), which ``json.loads`` passes
    through. A body of token ids has neither, and skips the walk over every element."""
    return b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw


def unpaired_surrogate(value: Any) -> str | None:
    """Path of the first string (key or value) that is not valid Unicode, or None."""
    stack: list[tuple[str, Any]] = [("body", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(node, dict):
            for k, v in node.items():
                name = k.encode("utf-8", "backslashreplace").decode()  # the path must encode too
                stack.append((f"{path}.{name}", v))
                stack.append((f"{path}.{name} (the key)", k))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
    return None


async def json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object body, within ``max_bytes`` (see module doc)."""
    raw = await read_body(request, max_bytes)
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_object, raw)
    return parse_object(raw)
