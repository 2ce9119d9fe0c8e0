"""Version guard for the vLLM-CPU integration: the patches were written against vLLM 0.32.x."""

from __future__ import annotations

SUPPORTED_VLLM_PREFIX = "0.32."


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not the version loraplex's CPU MoE-LoRA patches were written for."""


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported(version: str | None = None) -> bool:
    """True when ``version`` (default: the installed vLLM) is a 0.32.x release."""
    return (version or installed_vllm_version()).startswith(SUPPORTED_VLLM_PREFIX)


def check_vllm_version() -> str:
    """Returns the installed vLLM version; raises ``UnsupportedVLLMVersionError`` if not 0.32.x."""
    version = installed_vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMVersionError(
            f"loraplex's CPU MoE-LoRA path supports vLLM {SUPPORTED_VLLM_PREFIX}x, found {version}; "
            "set LORAPLEX_MOE_LORA=0 to run without it (adapters with expert LoRA are then refused)"
        )
    return version
