"""Request bodies of the OpenAI routes: the fields the gateway acts on, and the documented shape.

vLLM's serving layer stays the authority on what a valid request is. ``GatewayFields`` checks only
what the gateway itself reads (``model``, ``stream``, token counts, ``n``), so hostile values are
refused with a 400 naming the field, while every other field passes through to vLLM unchanged.
``CompletionBody`` / ``ChatCompletionBody`` describe the usual OpenAI fields in the OpenAPI
schema (clients, fuzzers); they are documentation, never used to validate.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import BadRequest


class GatewayFields(BaseModel):
    """What the gateway reads from a body; unknown fields are kept for vLLM."""

    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="An adapter id, or the base model's served name.")
    stream: bool | None = Field(None, description="Server-sent events instead of one JSON answer.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(None, description="Most tokens to generate (chat; wins over max_tokens).")
    n: int | None = Field(None, description="Completions to generate for the prompt.")

    @classmethod
    def of(cls, body: dict[str, Any]) -> "GatewayFields":
        """The body's gateway fields; ``BadRequest`` naming each wrong one."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]]
            raise BadRequest("invalid request body: " + "; ".join(parts)) from None


class _Sampling(GatewayFields):
    temperature: float | None = Field(None, description="Sampling temperature (0: greedy).")
    top_p: float | None = Field(None, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, description="Sample among the k most likely tokens.")
    stop: str | list[str] | None = Field(None, description="Strings that end the generation.")
    seed: int | None = Field(None, description="Sampling seed.")
    ignore_eos: bool | None = Field(None, description="Keep generating after the end-of-sequence token (vLLM).")
    return_tokens_as_token_ids: bool | None = Field(None, description="Tokens as 'token_id:N' in logprobs (vLLM).")


class CompletionBody(_Sampling):
    """``POST /v1/completions`` (OpenAI's completions request; vLLM's extensions pass through)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="Text or token ids to continue.")
    logprobs: int | None = Field(None, description="Log-probabilities of the most likely tokens.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(description="system, user, assistant or tool.")
    content: str | list[dict[str, Any]] | None = Field(None, description="Text, or content parts.")


class ChatCompletionBody(_Sampling):
    """``POST /v1/chat/completions`` (OpenAI's chat request; vLLM's extensions pass through)."""

    messages: list[ChatMessage] = Field(description="The conversation so far.")
    logprobs: bool | None = Field(None, description="Return log-probabilities of the output tokens.")
    top_logprobs: int | None = Field(None, description="Alternatives per output token with logprobs.")


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body itself: the body's JSON schema, with its
    ``$defs`` inlined (the OpenAPI document has no place for them there)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
