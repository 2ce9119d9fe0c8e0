"""vLLM 0.24, MXFP4 experts (GPT-OSS) with LoRA: keep the Triton MXFP4 GEMMs, add LoRA beside.

Without LoRA, vLLM 0.24 on Hopper runs MXFP4 experts with ``OAITritonExperts`` (triton_kernels'
``matmul_ogs`` with the activation fused in). That class cannot take LoRA, so with LoRA enabled
the automatic choice falls through to Marlin, a slower base GEMM. vLLM also ships
``UnfusedOAITritonExperts``: the same ``matmul_ogs`` GEMMs with the activation and the top-k sum
as separate steps, where the LoRA deltas are added (through ``LoRAExpertsMixin``, i.e. through
loraplex's kernels once ``kernels.vllm_cuda`` is installed); vLLM leaves it out of the automatic
order because of a bug with MTP speculative decoding.

``install`` wraps the MXFP4 backend selection used by vLLM's MXFP4 quantisation method: when
LoRA is enabled, the backend is left on automatic, no activation quantisation is requested, no
speculative decoding is configured and the unfused Triton class supports the configuration,
that class is chosen; otherwise vLLM's own choice stands. An explicit ``moe_backend`` always wins.
"""

from __future__ import annotations

_original = None


def _lora_choice(config, activation_key):
    """``(backend, experts class)`` for LoRA on MXFP4 experts, or None to defer to vLLM."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle

    vllm_config = get_current_vllm_config_or_none()
    if (not config.is_lora_enabled or config.moe_backend != "auto" or activation_key is not None
            or config.moe_parallel_config.use_batched_activation_format
            or (vllm_config is not None and vllm_config.speculative_config is not None)):
        return None
    try:
        return oracle._return_or_raise(oracle.Mxfp4MoeBackend.TRITON_UNFUSED, config,
                                       oracle.kMxfp4Static, None,
                                       mk.FusedMoEActivationFormat.Standard)
    except ValueError:  # not supported here (e.g. no triton_kernels, not Hopper/Blackwell)
        return None


def _select(config, activation_key=None):
    return _lora_choice(config, activation_key) or _original(config, activation_key)


def install() -> None:
    """Wraps ``select_mxfp4_moe_backend`` as the MXFP4 method looks it up (idempotent)."""
    global _original
    from vllm.model_executor.layers.quantization import mxfp4

    if _original is None:
        _original = mxfp4.select_mxfp4_moe_backend
        mxfp4.select_mxfp4_moe_backend = _select


def uninstall() -> None:
    global _original
    from vllm.model_executor.layers.quantization import mxfp4

    if _original is not None:
        mxfp4.select_mxfp4_moe_backend = _original
        _original = None
