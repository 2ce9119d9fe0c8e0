"""Which LoRA modules a step can skip: no adapter of the step carries weights for them.

vLLM runs every LoRA-wrapped module's ops for every step that has any adapter, also modules no
resident adapter targets (GPT-OSS's router when adapters cover attention and experts; the
experts when an adapter covers attention only): their weights are zero, the result unchanged,
the launches paid. In a step without CUDA graphs (prefill) that is host time per module.

Two facts, kept on the host by wrapping two vLLM 0.24 methods:

- per module, the slots whose current adapter has weights for it (``activate_adapter`` copies
  an adapter's weights into a slot, or resets the module's slot when it has none);
- per step, the slots its tokens use (``PunicaWrapperGPU.update_metadata``, once per step,
  outside CUDA graphs).

``skippable(first_a_stack)`` is true when the two do not meet. Never while a CUDA graph is
being captured (the graph must hold the launches for later steps) and never for a module whose
slots were not tracked. Keys are the data pointers of the modules' first A stacks (allocated
once at model load).
"""

from __future__ import annotations

import torch

_originals: dict[str, object] = {}
_live: dict[int, set[int]] = {}  # module key -> slots whose adapter has weights there
_step: dict[str, frozenset | None] = {"slots": None}  # slots this step's tokens use


def module_key(module) -> int | None:
    """The key of a LoRA module: data pointer of its first A stack (None: not a LoRA module)."""
    stacks = getattr(module, "w13_lora_a_stacked", None) or getattr(module, "lora_a_stacked",
                                                                     None)
    if stacks is None:
        return None
    first = stacks if isinstance(stacks, torch.Tensor) else stacks[0]
    return first.data_ptr()


def record_slot(manager, index: int, lora_model) -> None:
    """After ``activate_adapter`` put ``lora_model`` in slot ``index``: per module, whether
    that slot now holds weights."""
    for name, module in manager.modules.items():
        key = module_key(module)
        if key is None:
            continue
        live = _live.setdefault(key, set())
        if manager._get_lora_layer_weights(lora_model, name):
            live.add(index)
        else:
            live.discard(index)


def record_step(index_mapping, lora_index_to_id) -> None:
    """The slots of this step's tokens (``index_mapping``: adapter id per token, 0 none)."""
    ids = set(index_mapping)
    _step["slots"] = frozenset(lora_index_to_id.index(i) for i in ids
                               if i > 0 and i in lora_index_to_id)


def skippable(first_a_stack: torch.Tensor) -> bool:
    """True when no slot of this step has weights for the module of ``first_a_stack``."""
    live = _live.get(first_a_stack.data_ptr())
    slots = _step["slots"]
    if live is None or slots is None or not live.isdisjoint(slots):
        return False
    return not (first_a_stack.is_cuda and torch.cuda.is_current_stream_capturing())


def _activate_adapter(self, lora_id: int) -> bool:
    done = _originals["activate_adapter"](self, lora_id)
    if done:
        record_slot(self, self.lora_index_to_id.index(lora_id), self._registered_adapters[lora_id])
    return done


def _update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
    _originals["update_metadata"](self, mapping, lora_index_to_id, max_loras, vocab_size,
                                  **kwargs)
    record_step(mapping.index_mapping, lora_index_to_id)


def install() -> None:
    """Wraps ``LoRAModelManager.activate_adapter`` and ``PunicaWrapperGPU.update_metadata``
    (the caller checks the vLLM version)."""
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    if _originals:
        return
    _originals["activate_adapter"] = LoRAModelManager.activate_adapter
    _originals["update_metadata"] = PunicaWrapperGPU.update_metadata
    LoRAModelManager.activate_adapter = _activate_adapter
    PunicaWrapperGPU.update_metadata = _update_metadata


def uninstall() -> None:
    """Restores vLLM's methods and forgets what was tracked (tests)."""
    if not _originals:
        return
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    LoRAModelManager.activate_adapter = _originals.pop("activate_adapter")
    PunicaWrapperGPU.update_metadata = _originals.pop("update_metadata")
    _live.clear()
    _step["slots"] = None
