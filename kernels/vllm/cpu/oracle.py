"""Keep vLLM-CPU's native MoE experts when LoRA is enabled (vLLM 0.32.x).

vLLM 0.32's unquantized MoE oracle (``select_unquantized_moe_backend``) returns the Triton backend
whenever ``FusedMoEConfig.is_lora_enabled`` is set, on every platform. On CPU there is no Triton,
so an MoE model with ``enable_lora=True`` dies on its first forward pass, even for requests
without an adapter. This patch makes the oracle ignore ``is_lora_enabled`` on the CPU platform
and select among the CPU experts classes as without LoRA.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
from typing import Any, Callable

from kernels.vllm.patching import Patches

# Under vLLM's logger so the messages show in the engine's log.
logger = logging.getLogger("vllm.loraplex.oracle")

_ORACLE_MODULE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
# Modules that imported the oracle function by name and so hold their own reference.
_IMPORTER_MODULES = ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",)


def select_without_lora(original: Callable[..., Any], moe_config: Any) -> Any:
    """Runs the original oracle on a shallow copy of ``moe_config`` with ``is_lora_enabled=False``."""
    config = copy.copy(moe_config)
    config.is_lora_enabled = False
    return original(config)


def make_cpu_oracle(
    original: Callable[..., Any],
    choose_experts_cls: Callable[[Any, Any], Any] | None = None,
) -> Callable[..., Any]:
    """Wraps ``select_unquantized_moe_backend``: on CPU with LoRA, select as without LoRA.

    ``choose_experts_cls(moe_config, selected_cls)`` may replace the selected experts class (the
    expert-LoRA path substitutes a LoRA-capable CPU experts class there).
    """

    @functools.wraps(original)
    def select_unquantized_moe_backend(moe_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.platforms import current_platform

        if not (current_platform.is_cpu() and moe_config.is_lora_enabled):
            return original(moe_config, *args, **kwargs)
        backend, experts_cls = select_without_lora(original, moe_config)
        if choose_experts_cls is not None:
            experts_cls = choose_experts_cls(moe_config, experts_cls)
        logger.info(
            "loraplex: CPU MoE with LoRA enabled uses %s (%s) instead of Triton",
            backend,
            getattr(experts_cls, "__name__", experts_cls),
        )
        return backend, experts_cls

    return select_unquantized_moe_backend


def patch_unquantized_oracle(
    patches: Patches, choose_experts_cls: Callable[[Any, Any], Any] | None = None,
) -> None:
    """Installs the wrapper in the oracle module and in every module holding the oracle function
    by name (``UnsupportedVLLMError`` where one holds something else)."""
    oracle = importlib.import_module(_ORACLE_MODULE)
    current = oracle.select_unquantized_moe_backend
    wrapped = make_cpu_oracle(current, choose_experts_cls)
    patches.replace(oracle, "select_unquantized_moe_backend", wrapped, expect=current)
    for name in _IMPORTER_MODULES:
        patches.replace(importlib.import_module(name), "select_unquantized_moe_backend", wrapped,
                        expect=current)
