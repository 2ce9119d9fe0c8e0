"""The ``observability`` section of the application's arguments (``AppConfig.observability``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ObservabilityConfig(BaseModel):
    """Label cardinality caps and request logs; both apply per process (gateway or engine replica)."""

    model_config = ConfigDict(extra="forbid")

    max_tenant_labels: int = Field(
        100, ge=1, description="Distinct tenant label values a process exports; later tenants are counted as 'other'."
    )
    max_adapter_labels: int = Field(
        500, ge=1, description="Distinct adapter label values a process exports; later adapters are counted as 'other'."
    )
    request_logs: bool = Field(
        True, description="One JSON line per request from the gateway and from the engine replica (ids, tenant, "
        "adapter, replica, timings, status; never prompts, outputs or keys)."
    )
