"""loraplex's punica wrapper: vLLM 0.24's GPU wrapper with the per-step mapping prepared on the
host (``kernels.vllm.cuda.mapping``), the step's slots recorded for skipping idle modules
(``kernels.vllm.cuda.live``) and dense LoRA through loraplex's ops (``kernels.vllm.cuda.dense``).

vLLM builds each LoRA model's punica wrapper from the class its platform names
(``Platform.get_punica_wrapper``, resolved by qualified name): ``install`` makes the CUDA
platform name ``LoraplexPunicaWrapper``, so no method of vLLM's own class is swapped. While
loraplex's CUDA path is not installed (``kernels.vllm.cuda.uninstall``, as the equality benchmark
does between passes) an existing wrapper behaves exactly as vLLM's.
"""

from __future__ import annotations

from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

from kernels.vllm.cuda import dense, live, mapping
from kernels.vllm.patching import Patches

_installed = [False]  # loraplex's CUDA path is installed: its wrapper runs loraplex's code


def _ours() -> bool:
    """A flag of the process (read as a constant when torch.compile traces a forward)."""
    return _installed[0]


class LoraplexPunicaWrapper(PunicaWrapperGPU):
    """``PunicaWrapperGPU`` with loraplex's step mapping and dense LoRA (module doc)."""

    def update_metadata(self, mapping_, lora_index_to_id, max_loras, vocab_size, **kwargs):
        if not _ours():
            return super().update_metadata(mapping_, lora_index_to_id, max_loras, vocab_size,
                                           **kwargs)
        mapping.update_metadata(self, mapping_, lora_index_to_id, max_loras, vocab_size)
        live.record_step(mapping_.index_mapping, lora_index_to_id)
        return None

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *,
                        buffer=None, **kwargs):
        if (buffer is not None or not _ours()
                or not dense.supported(lora_a_stacked, lora_b_stacked, x)):
            return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale,
                                           output_slices, buffer=buffer, **kwargs)
        dense.add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale,
                              kwargs.get("add_inputs", True))
        return None


QUALNAME = f"{LoraplexPunicaWrapper.__module__}.{LoraplexPunicaWrapper.__qualname__}"


def _name_ours(cls) -> str:
    return QUALNAME


def install(patches: Patches) -> None:
    """The CUDA platform names ``LoraplexPunicaWrapper`` (the caller checks the vLLM version)."""
    from vllm.platforms import current_platform

    patches.replace(type(current_platform), "get_punica_wrapper", classmethod(_name_ours))
    _installed[0] = True


def reset() -> None:
    """Existing wrappers behave as vLLM's again (after the patches are undone)."""
    _installed[0] = False
