"""What the gateway tells an engine replica about a request besides its body (crosses Ray as a dict)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RequestMeta(BaseModel):
    """A request's identity on the serving path."""

    request_id: str = Field(description="The request id (app.request_ids); vLLM's request id is made from it.")
    tenant: str = Field(description="The authenticated tenant's name.")
    adapter: str = Field(description="The adapter id, or the base model's served name.")
