"""Can the serving engine apply an adapter's MoE-expert LoRA? Used to refuse adapters up front.

vLLM-CPU has no MoE-expert LoRA of its own: without loraplex's plugin it either crashes or (with
LoRA targets limited to attention) silently serves an adapter's expert weights as if they were
absent. ``engine_applies_expert_lora()`` tells the app whether the engine in this environment
applies them, so an adapter with expert LoRA is refused with ``expert_lora_unavailable_reason()``
instead of being served wrong. The answer depends on the platform vLLM runs on, the switch
``LORAPLEX_MOE_LORA``, vLLM's plugin filter ``VLLM_PLUGINS`` and the installed vLLM version; vLLM's
engine processes inherit the environment of the process that asks.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "loraplex_moe_lora"


class ExpertLoRAUnavailableError(RuntimeError):
    """An adapter has MoE-expert LoRA but the engine here cannot apply it."""


def _platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_type", "unknown") or "unknown")


def plugin_will_load() -> bool:
    """True if vLLM will load loraplex's general plugin in its processes (installed entry point,
    not excluded by ``VLLM_PLUGINS``)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in {p.strip() for p in allowed.split(",")}:
        return False
    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP))


def expert_lora_unavailable_reason(platform: str | None = None) -> str | None:
    """Why the engine cannot apply MoE-expert LoRA here, or None if it can.

    ``platform``: ``"cpu"`` or ``"cuda"`` (default: the platform vLLM detects).
    On CUDA vLLM applies expert LoRA itself (loraplex's kernels only replace its implementation).
    On CPU it needs loraplex's plugin, switched on, for vLLM 0.32.x.
    """
    from kernels.vllm.plugin import SWITCH_ENV, enabled
    from kernels.vllm.versions import CPU, installed_version

    platform = platform or _platform()
    if platform == "cuda":
        return None
    if platform != "cpu":
        return f"MoE-expert LoRA is not supported on the {platform} platform"
    if not enabled():
        return (
            f"MoE-expert LoRA on CPU needs loraplex's vLLM plugin, which is switched off "
            f"({SWITCH_ENV}={os.environ.get(SWITCH_ENV)})"
        )
    if not plugin_will_load():
        return (
            f"MoE-expert LoRA on CPU needs loraplex's vLLM plugin '{PLUGIN_NAME}', which vLLM will "
            "not load (entry point missing or excluded by VLLM_PLUGINS)"
        )
    version = installed_version()
    if not CPU.supports(version):
        return f"loraplex's CPU MoE-expert LoRA supports {CPU}, found vLLM {version}"
    return None


def engine_applies_expert_lora(platform: str | None = None) -> bool:
    """True if an engine started in this environment applies adapters' MoE-expert LoRA."""
    return expert_lora_unavailable_reason(platform) is None


def require_expert_lora(adapter_id: str, platform: str | None = None) -> None:
    """Raises ``ExpertLoRAUnavailableError`` naming the adapter and the reason, if the engine
    cannot apply expert LoRA; call it for adapters that have expert LoRA."""
    reason = expert_lora_unavailable_reason(platform)
    if reason is not None:
        raise ExpertLoRAUnavailableError(
            f"adapter {adapter_id!r} has MoE-expert LoRA weights, which this engine cannot apply: "
            f"{reason}; refusing it rather than serving it without them"
        )
