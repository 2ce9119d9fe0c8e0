"""Where vLLM 0.24 keeps its Triton MXFP4 experts (GPT-OSS): the module and the unfused class
that takes LoRA, looked up in one place for the MoE and MXFP4 integrations."""

from __future__ import annotations


def oai_module():
    """vLLM 0.24's module of the Triton MXFP4 experts: ``matmul_ogs``, ``_resize_cache``,
    ``FUSED_MOE_UNQUANTIZED_CONFIG`` and the experts classes."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe

    return gpt_oss_triton_kernels_moe


def unfused_class():
    """vLLM's ``UnfusedOAITritonExperts`` (None without ``triton_kernels``)."""
    from vllm.utils.import_utils import has_triton_kernels

    return oai_module().UnfusedOAITritonExperts if has_triton_kernels() else None
