"""The gate of the tests that need a CUDA GPU with vLLM 0.24 (the GPU machine's stack)."""

from __future__ import annotations

import pytest
import torch


def vllm024_gpu() -> bool:
    """True with a CUDA GPU and vLLM 0.24.x importable."""
    if not torch.cuda.is_available():
        return False
    try:
        import vllm
    except ImportError:
        return False
    return vllm.__version__.startswith("0.24.")


needs_vllm024_gpu = pytest.mark.skipif(not vllm024_gpu(), reason="needs a CUDA GPU with vLLM 0.24")
