"""The scheduler rules' settings, carried in vLLM's ``additional_config[SETTINGS_KEY]``."""

from __future__ import annotations

from pydantic import BaseModel, Field

SETTINGS_KEY = "loraplex_scheduler"


class SchedulerSettings(BaseModel):
    """The rules' settings (``additional_config[SETTINGS_KEY]``)."""

    preempt_margin: int = Field(0, ge=0, description="Priority units by which a waiting request must lead the "
                                "worst running one to take its place in a full batch.")
    slot_quantum_s: float | None = Field(None, gt=0, description="Seconds an adapter holds a GPU LoRA slot before "
                                         "yielding it to a blocked adapter (None: no rotation).")


def settings_of(vllm_config) -> SchedulerSettings:
    """The settings ``vllm_config`` carries (the defaults, all rules off, where it carries none)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return SchedulerSettings.model_validate(extra.get(SETTINGS_KEY, {}) if isinstance(extra, dict) else {})
