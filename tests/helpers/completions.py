"""Completions through a stack, as token ids: streamed (SSE) or not, with what answered them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx


@dataclass
class Completion:
    status: int
    tokens: list[int] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    replica: str | None = None
    model: str | None = None  # the engine-side name: ``<id>@v<n>.<digest prefix>``
    error: dict | None = None  # an error body (the answer's, or an SSE error event's)
    done: bool = False  # the stream ended with ``[DONE]``
    retry_after: str | None = None


def _token_ids(logprobs: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]]


def complete(stack, headers: dict, body: dict, timeout: float = 300, first_token=None) -> Completion:
    """A completion (``body`` as the client sends it) with token ids: ``return_tokens_as_token_ids``
    and ``logprobs`` are added (``logprobs`` defaults to 1). ``first_token`` (an Event) is set when
    a stream's first token arrives."""
    body = {"logprobs": 1, **body, "return_tokens_as_token_ids": True}
    url = stack.base_url + "/v1/completions"
    if not body.get("stream"):
        r = httpx.post(url, headers=headers, json=body, timeout=timeout)
        out = Completion(r.status_code, replica=r.headers.get("x-loraplex-replica"),
                         retry_after=r.headers.get("retry-after"))
        data = r.json()
        if r.status_code != 200:
            out.error = data
            return out
        choice = data["choices"][0]
        out.tokens, out.top_logprobs = _token_ids(choice["logprobs"]), choice["logprobs"]["top_logprobs"]
        out.model, out.done = data["model"], True
        return out
    with httpx.stream("POST", url, headers=headers, json=body, timeout=timeout) as s:
        out = Completion(s.status_code, replica=s.headers.get("x-loraplex-replica"),
                         retry_after=s.headers.get("retry-after"))
        if s.status_code != 200:
            s.read()
            out.error = s.json()
            return out
        for line in s.iter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event
                    continue
                out.model = event.get("model", out.model)
                for choice in event.get("choices", []):
                    if choice.get("logprobs"):
                        out.tokens += _token_ids(choice["logprobs"])
                        out.top_logprobs += choice["logprobs"]["top_logprobs"]
                        if first_token is not None:
                            first_token.set()
    return out
