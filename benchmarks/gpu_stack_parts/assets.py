"""What every system shares: the model folder, the adapter folders and the tenants file.

Models: ``gptoss`` / ``gptoss-mxfp4`` (the GPT-OSS-20B shape, random weights loaded with
``load_format: dummy`` and rebalanced in every engine process by the balanced-dummy plugin, a
word-level tokenizer; ``benchmarks.engine.gpt_oss_dummy``) or ``embedded`` (the tiny Qwen3-MoE of
``loraplex init``, real weights, fp32, vLLM-CPU).

Adapters come in families per rank, ids ``r<rank>-<i>``, owner ``tenant_of(i)``: the first of a
family is drawn by ``benchmarks.synthetic_adapters`` (GPT-OSS: attention + fused 3-D experts,
bf16, scale 0.002 so that the dummy model's routing stays as without adapters; embedded:
attention only, fp32), the others are its tensors rotated by the adapter's index (flattened),
so each has bytes of its own (the disk cache is content-addressed) at the cost of a file write.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from benchmarks.gpu_stack_parts.plan import TENANTS, tenant_of

OPERATOR = "bench-operator"

MODELS = ("gptoss-mxfp4", "gptoss", "embedded")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GPT_OSS_LORA_SCALE = 0.002
EMBEDDED_LORA_SCALE = 0.05


class ModelAssets(BaseModel):
    """The base model as every system loads it."""

    kind: str = Field(description="gptoss, gptoss-mxfp4 or embedded.")
    model_dir: Path = Field(description="Hugging Face folder (config, tokenizer; weights only for embedded).")
    home: Path = Field(description="LORAPLEX_HOME of the loraplex server.")
    engine: dict[str, Any] = Field(description="What this host overrides in deploy/h200.yaml's engine section.")
    gpu: bool = Field(description="A GPU host (else vLLM-CPU).")

    @property
    def balanced_dummy(self) -> bool:
        return self.kind != "embedded"


def prepare_model(kind: str, workdir: Path) -> ModelAssets:
    """The model folder (made once in ``workdir``) and the engine settings it needs here."""
    home = workdir / "home"
    if kind == "embedded":
        from app.embedded.setup import init, model_dir

        init(home, progress=False)
        engine = {"model": str(model_dir(home)), "dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
                  "max_num_batched_tokens": 1024, "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 8,
                  "lora_target_modules": list(ATTENTION), "cpu_kvcache_space_gib": 1}
        return ModelAssets(kind=kind, model_dir=model_dir(home), home=home, engine=engine, gpu=False)
    from benchmarks.engine.gpt_oss_dummy import write_model_dir, write_tokenizer

    folder = write_tokenizer(write_model_dir(workdir / "models", mxfp4=kind.endswith("mxfp4")))
    return ModelAssets(kind=kind, model_dir=folder, home=home, engine={"model": str(folder), "load_format": "dummy"},
                       gpu=True)


@functools.lru_cache(maxsize=2)
def _template_tensors(path: str) -> dict:
    """A template's tensors, read once per run (the adapters of a family are written from them,
    several at a time; nothing writes into them)."""
    from safetensors.torch import load_file

    return load_file(path)


def _rotated(tensors: dict, k: int) -> dict:
    import torch

    return {n: torch.roll(t.flatten(), k).view_as(t).contiguous() for n, t in tensors.items()}


def write_adapters(assets: ModelAssets, root: Path, rank: int, indices: list[int], prefix: str = "",
                   offset: int = 0, expert_lora: bool = True) -> dict[str, Path]:
    """Folders of adapters ``<prefix>r<rank>-<i>`` for ``indices`` (existing ones kept), the
    template rotated by ``offset + i + 1``: another offset gives other bytes. The template is
    made by the first call of a rank (``indices`` may be empty); later calls may run at once."""
    from safetensors.torch import save_file

    from adapters_registry.manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo
    from benchmarks.synthetic_adapters import synthetic_adapter

    base = BaseModelInfo.from_model_dir(assets.model_dir)
    template = root / f"template-r{rank}"
    if not (template / WEIGHTS_NAME).exists():
        gpu = assets.kind != "embedded"
        synthetic_adapter(template, base, r=rank, alpha=2 * rank, experts="3d" if gpu and expert_lora else "none",
                          dtype="bfloat16" if gpu else "float32", seed=1000 + rank,
                          scale=GPT_OSS_LORA_SCALE if gpu else EMBEDDED_LORA_SCALE)
    out = {}
    for i in indices:
        folder = root / f"{prefix}r{rank}-{i}"
        if not (folder / WEIGHTS_NAME).exists():
            tensors = _template_tensors(str(template / WEIGHTS_NAME))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / CONFIG_NAME).write_text((template / CONFIG_NAME).read_text())
            part = folder / f"{WEIGHTS_NAME}.part"  # renamed once whole: a stopped run leaves no short file
            save_file(_rotated(tensors, offset + i + 1), str(part), metadata={"format": "pt"})
            part.rename(folder / WEIGHTS_NAME)
        out[folder.name] = folder
    return out


def write_tenants(path: Path) -> dict[str, str]:
    """A tenants file with one key for each of the ``TENANTS`` tenants (limits high enough for
    every phase) and one for ``OPERATOR``; returns tenant -> key."""
    from app.gateway.tenants import TenantsFile

    doc = TenantsFile()
    keys = {tenant_of(i): doc.add_key(tenant_of(i), max_concurrency=1024) for i in range(TENANTS)}
    keys[OPERATOR] = doc.add_key(OPERATOR, operator=True)  # the admin API: metrics targets
    doc.write(path)
    return keys
