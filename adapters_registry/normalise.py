"""Turn a validated adapter folder into the files that get published.

Fused 3-D expert LoRA is converted to per-expert 2-D (what vLLM's Qwen3-MoE loader expects in
this vLLM version) with :func:`adapters_registry.peft_layouts.fused_to_per_expert` (exact slicing), and the
result is validated again against the base model; ``target_layout="as_is"`` keeps the pushed
layout. Adapters without fused experts are published byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .errors import AdapterInvalid
from .manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo
from .validation import AdapterReport, inspect_adapter

TargetLayout = Literal["2d", "as_is"]


def prepare_files(
    src_dir: Path,
    base: BaseModelInfo,
    report: AdapterReport,
    work_dir: Path,
    target_layout: TargetLayout = "2d",
    max_lora_rank: int = 64,
) -> tuple[dict[str, Path], str]:
    """Files to publish (name → path) and their expert layout (``"2d"``/``"3d"``/``"none"``)."""
    src = Path(src_dir)
    if report.layout != "3d" or target_layout == "as_is":
        return {CONFIG_NAME: src / CONFIG_NAME, WEIGHTS_NAME: src / WEIGHTS_NAME}, report.layout
    import json

    from safetensors.torch import load_file, save_file

    from adapters_registry.peft_layouts import AdapterLayoutError, fused_to_per_expert

    try:
        tensors, cfg = fused_to_per_expert(
            load_file(str(src / WEIGHTS_NAME)), report.config, gate_up_interleaved=base.gate_up_interleaved
        )
    except AdapterLayoutError as e:
        raise AdapterInvalid(f"fused expert LoRA: {e}") from e
    work_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(work_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (work_dir / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    converted = inspect_adapter(work_dir, base, max_lora_rank, check_values=False)
    if converted.layout != "2d":
        raise AdapterInvalid(f"fused expert LoRA conversion produced layout {converted.layout!r}, not 2d")
    return {CONFIG_NAME: work_dir / CONFIG_NAME, WEIGHTS_NAME: work_dir / WEIGHTS_NAME}, "2d"
