"""The gateway's input hygiene over real HTTP (an ASGI app around the functions the ingress calls):
bounded headers and bodies, RFC 8259 JSON objects of valid Unicode, typed gateway fields, each
refusal a JSON error that says what to fix; and the OpenAPI schema of the OpenAI routes. Also the
parse's fast path for bodies of token ids, and the token estimate of a prompt."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.errors import BadRequest, error_response
from app.gateway import request_limits
from app.gateway.ingress import _prompt_estimate
from app.gateway.openai_bodies import ChatCompletionBody, GatewayFields, openapi_body
from tests.helpers.aio import asynctest

LIMIT = 4096


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    async def route(request: Request):
        try:
            request_limits.check_headers(request, LIMIT)
            body = await request_limits.json_object(request, LIMIT)
            fields = GatewayFields.of(body)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"model": fields.model, "stream": fields.stream, "body": body})

    return app


async def _post(content: bytes, headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        return await c.post("/v1/chat/completions", content=content,
                            headers={"content-type": "application/json", **(headers or {})})


CASES = [  # body, status, words the message must contain
    (b'{"model": "m", "max_tokens": Infinity}', 400, ["Infinity", "not a JSON value"]),
    (b'{"model": "m", "temperature": NaN}', 400, ["NaN", "not a JSON value"]),
    (b'{"model": {"a": 1}}', 400, ["model", "string"]),
    (b'{"model": ["a"]}', 400, ["model"]),
    (b'{"model": "m", "max_tokens": 1.5}', 400, ["max_tokens"]),
    (b'{"model": "m", "stream": "perhaps"}', 400, ["stream"]),
    (b'{"model": "m", "n": "many"}', 400, ["n"]),
    (b'{"model": "m", "prompt": "a \\ud800 b"}', 400, ["surrogate", "body.prompt"]),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, ["body.messages[0].content"]),
    (b'{"\\ud800": 1}', 400, ["surrogate", "(the key)"]),
    (b'[1, 2]', 400, ["JSON object"]),
    (b'{"model": "m"', 400, ["not valid JSON"]),
    (b'', 400, ["not valid JSON"]),
    (b'{"a": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, ["not valid JSON"]),
    (b'{"p": "' + b"x" * LIMIT + b'"}', 413, ["body", str(LIMIT)]),
]


@pytest.mark.parametrize("body,status,words", CASES, ids=[c[0][:40].decode(errors="replace") for c in CASES])
@asynctest
async def test_refusals_are_json_errors_that_say_what_to_fix(body, status, words):
    r = await _post(body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], (word, err["message"])


@asynctest
async def test_valid_bodies_pass_through_unchanged():
    raw = '{"model": "acme", "stream": true, "messages": [{"role": "user", "content": "h\\u00e9 \\ud83d\\ude00"}], "extra": {"k": [1, 2.5, null]}}'
    r = await _post(raw.encode())
    assert r.status_code == 200
    out = r.json()
    assert out["model"] == "acme" and out["stream"] is True
    assert out["body"]["messages"][0]["content"] == "hé 😀" and out["body"]["extra"] == {"k": [1, 2.5, None]}


@asynctest
async def test_declared_or_streamed_body_above_the_limit_is_413():
    r = await _post(b"{}", headers={"content-length": str(10 * LIMIT)})
    assert r.status_code == 413 and str(10 * LIMIT) in r.json()["error"]["message"]

    async def chunks():
        for _ in range(8):
            yield b" " * 1024
        yield b"{}"

    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413 and "above the limit" in r.json()["error"]["message"]


@asynctest
async def test_headers_above_the_limit_are_431():
    r = await _post(b"{}", headers={"x-junk": "a" * LIMIT})
    assert r.status_code == 431 and "headers" in r.json()["error"]["message"]


def test_openapi_schema_documents_the_body_without_dangling_refs():
    schema = _app().openapi()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["required"] and body["properties"]["messages"]["items"]["properties"]["role"]
    assert "$ref" not in str(body) and "$defs" not in str(body)


@pytest.mark.parametrize("raw", [
    b'{"prompt": ["x", "\\uDC00"]}',  # a lone low surrogate, upper-case hex, in a list
    b'{"prompt": "a\xed\xa0\x80b"}',  # the UTF-8 bytes of one: json.loads passes them through
])
def test_surrogates_the_fast_path_must_not_miss(raw):
    assert request_limits.may_hold_surrogates(raw)
    with pytest.raises(BadRequest, match="unpaired UTF-16 surrogate in body"):
        request_limits.parse_object(raw)


def test_a_body_of_token_ids_is_parsed_without_the_walk():
    raw = json.dumps({"model": "a", "prompt": list(range(1600)), "max_tokens": 8}).encode()
    assert not request_limits.may_hold_surrogates(raw)
    assert request_limits.parse_object(raw)["prompt"][-1] == 1599


def test_prompt_estimates():
    assert _prompt_estimate(list(range(1600))) == 1600  # token ids: one each
    assert _prompt_estimate([[1, 2, 3], [4, 5]]) == 5  # a batch of token-id prompts
    assert _prompt_estimate("x" * 400) == 100  # text: ~4 characters a token
    assert _prompt_estimate([{"role": "user", "content": "x" * 400}]) >= 100  # messages
    assert _prompt_estimate(None) == 1 and _prompt_estimate([]) == 0
