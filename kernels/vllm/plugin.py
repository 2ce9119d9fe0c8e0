"""loraplex's vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM loads it in every process it starts (engine core, workers). One switch,
``LORAPLEX_MOE_LORA`` (``1``/unset: on, ``0``: off), turns loraplex's MoE-LoRA path on:

- CPU platform, on: ``kernels.vllm.cpu.install()`` keeps vLLM-CPU's native experts when LoRA is
  enabled and applies expert LoRA through the PyTorch CPU path (vLLM-CPU has none).
- CPU platform, off: ``kernels.vllm.cpu.install_without_expert_lora()`` still applies the fixes
  without which LoRA on an MoE model cannot run on CPU at all (native experts kept, adapter-less
  tokens fixed), but no expert LoRA: adapters carrying it are refused by the app
  (``kernels.vllm.capabilities``), and the engine targets non-expert modules only.
- CUDA platform, on: ``kernels.vllm.cuda.install()`` replaces vLLM's ``fused_moe_lora`` with
  loraplex's Triton kernels; off: stock vLLM.

Each ``install`` checks the installed vLLM version (``kernels.vllm.versions``) and refuses
(raises ``UnsupportedVLLMError``) on one it was not written for, so a mismatch fails loudly at
engine start instead of serving wrong outputs.

Diagnostics: ``LORAPLEX_SYNC_DEBUG=1`` turns on PyTorch's CUDA sync debug mode in every vLLM
process (``torch.cuda.set_sync_debug_mode("warn")``): each place that makes the host wait for the
GPU (``.item()``, blocking copies, ``nonzero``...) is reported once, with its file and line, in
the process's log — the steps of an engine with and without LoRA can then be compared.
``LORAPLEX_START_STACKS_S=N`` dumps the Python stacks of every thread of each vLLM process to its
stderr every N seconds for its first ``LORAPLEX_START_STACKS_UNTIL_S`` seconds (default 900): where
a slow engine start waits (the engine-core process's log says nothing until it has loaded).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading

SWITCH_ENV = "LORAPLEX_MOE_LORA"
SYNC_DEBUG_ENV = "LORAPLEX_SYNC_DEBUG"
STACKS_ENV, STACKS_UNTIL_ENV = "LORAPLEX_START_STACKS_S", "LORAPLEX_START_STACKS_UNTIL_S"
_stack_dumps: list[threading.Timer] = []  # this process's end-of-dumps timer, once started
logger = logging.getLogger(__name__)


def enabled() -> bool:
    """True unless the switch is set to a false value (``0``, ``false``, ``off``, ``no``)."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in {"0", "false", "off", "no"}


def sync_debug_from_env() -> bool:
    """``LORAPLEX_SYNC_DEBUG`` set to a true value: PyTorch's CUDA sync debug mode on ("warn");
    returns whether it was turned on (never without CUDA)."""
    if os.environ.get(SYNC_DEBUG_ENV, "").strip().lower() not in {"1", "true", "on", "yes"}:
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.set_sync_debug_mode("warn")
    logger.warning("%s: PyTorch's CUDA sync debug mode is on (every place that waits for the "
                   "GPU is reported once)", SYNC_DEBUG_ENV)
    return True


def stack_dumps_from_env() -> float | None:
    """``LORAPLEX_START_STACKS_S`` set: every thread's stack to stderr at that interval, until
    ``LORAPLEX_START_STACKS_UNTIL_S`` seconds from now or ``stop_stack_dumps()``; returns the
    interval (None: off, or already on in this process). ValueError names a bad setting."""
    raw = os.environ.get(STACKS_ENV, "").strip()
    if not raw or _stack_dumps:
        return None
    try:
        every, until = float(raw), float(os.environ.get(STACKS_UNTIL_ENV, "900"))
    except ValueError:
        raise ValueError(f"{STACKS_ENV} and {STACKS_UNTIL_ENV} must be seconds, got {raw!r} and "
                         f"{os.environ.get(STACKS_UNTIL_ENV)!r}") from None
    if every <= 0 or until <= 0:
        raise ValueError(f"{STACKS_ENV} and {STACKS_UNTIL_ENV} must be > 0")
    faulthandler.dump_traceback_later(every, repeat=True, file=sys.__stderr__)  # fd 2 (a capture may replace sys.stderr)
    timer = threading.Timer(until, faulthandler.cancel_dump_traceback_later)
    timer.daemon = True
    timer.start()
    _stack_dumps.append(timer)
    logger.warning("%s: stacks of process %d every %.0f s for %.0f s", STACKS_ENV, os.getpid(), every, until)
    return every


def stop_stack_dumps() -> None:
    """Ends this process's stack dumps (a replica calls it once its start is over)."""
    faulthandler.cancel_dump_traceback_later()
    for timer in _stack_dumps:
        timer.cancel()


def register() -> None:
    """vLLM plugin hook: installs the path for the current platform and switch (each install
    is idempotent, so vLLM may call this more than once per process)."""
    from vllm.platforms import current_platform

    sync_debug_from_env()
    stack_dumps_from_env()
    if current_platform.is_cpu():
        from kernels.vllm import cpu

        cpu.install() if enabled() else cpu.install_without_expert_lora()
    elif current_platform.is_cuda():
        if enabled():
            from kernels.vllm import cuda

            cuda.install()
    else:
        logger.warning("loraplex MoE-LoRA: platform %s not supported", current_platform)
