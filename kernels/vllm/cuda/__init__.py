"""vLLM 0.24 on CUDA: loraplex's Triton ops inside vLLM's LoRA layers (called by
``kernels.vllm.plugin.register``).

``install`` checks the vLLM version (``kernels.vllm.versions.CUDA``) and makes, through one
``Patches``:

- ``moe``: the MoE layers' LoRA (``LoRAExpertsMixin.apply_w13_lora`` / ``apply_w2_lora``) runs
  loraplex's MoE-LoRA kernels, compiled when vLLM sets up each layer's LoRA (``warmup``);
- ``mxfp4``: MXFP4 experts keep vLLM's Triton MXFP4 GEMMs under LoRA (instead of Marlin), with
  the row moves done inside the GEMMs;
- ``lora_loads``: an adapter's host work for ``add_lora`` prepared off the engine's loop;
- ``punica``: the platform's punica wrapper is loraplex's subclass of vLLM's, which prepares each
  step's LoRA mapping on the host (``mapping``), tracks which modules a step's adapters have
  weights for (``live``) and runs the dense (attention, router) LoRA through loraplex's ops
  (``dense``).

Triton compiles after the warm-up are reported in the engine's log (``warmup.watch_compiles``).
"""

from __future__ import annotations

from kernels.vllm.patching import Patches
from kernels.vllm.versions import CUDA, require

PATCHES = Patches("loraplex's CUDA MoE-LoRA path")
WHAT = "loraplex's CUDA MoE-LoRA path"


def install() -> None:
    """Installs the CUDA path once per process; raises ``UnsupportedVLLMError`` on any vLLM
    other than 0.24.x."""
    if PATCHES.active:
        return
    version = require(CUDA, WHAT)
    from kernels.vllm import lora_loads
    from kernels.vllm.cuda import dense, live, moe, mxfp4, punica, warmup

    try:
        lora_loads.install(PATCHES)
        moe.install(PATCHES)
        mxfp4.install(PATCHES)
        dense.install(PATCHES)
        live.install(PATCHES)
        punica.install(PATCHES)
    except BaseException:
        uninstall()
        raise
    warmup.watch_compiles()
    warmup.vllm_logger().info("MoE-LoRA Triton ops (loraplex) installed for vLLM %s", version)


def installed() -> bool:
    return PATCHES.active


def uninstall() -> None:
    """Restores vLLM's own functions and forgets what was tracked (tests, the equality bench)."""
    from kernels.vllm import lora_loads
    from kernels.vllm.cuda import dense, live, mapping, moe, punica

    PATCHES.undo()
    lora_loads.reset()
    punica.reset()
    moe.reset()
    dense.reset()
    live.reset()
    mapping.reset()
