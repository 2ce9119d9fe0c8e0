"""The gate of the tests that need a CUDA GPU with vLLM 0.24 (the GPU machine's stack).

Without a CUDA GPU they skip. With one, vLLM must import and be the version loraplex's CUDA
path supports (``kernels.vllm.versions``): anything else fails every such test (the
``vllm_gpu_stack`` fixture of tests/conftest.py) instead of skipping it, so a broken GPU install
cannot pass as "nothing to test".
"""

from __future__ import annotations

import pytest
import torch


def gpu_stack_problem() -> str | None:
    """Why the GPU tests cannot run on this CUDA machine (None: they can)."""
    from kernels.vllm.versions import CUDA

    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - reported as the reason every GPU test fails
        return f"vLLM does not import on this CUDA machine: {type(e).__name__}: {e}"
    if not CUDA.supports(vllm.__version__):
        return f"vLLM {vllm.__version__} on this CUDA machine; loraplex's CUDA path supports {CUDA}"
    return None


if torch.cuda.is_available():
    needs_vllm024_gpu = pytest.mark.usefixtures("vllm_gpu_stack")
else:
    needs_vllm024_gpu = pytest.mark.skipif(True, reason="needs a CUDA GPU with vLLM 0.24")
