"""Manifest of a published adapter version, and what the registry knows of the base model.

``manifest.json`` sits next to the adapter files in ``<adapter_id>/<version>/``; it is written
last, so a version without it is incomplete and invisible to readers.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import AdapterInvalid

MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


class ManifestFile(BaseModel):
    """One adapter file as published."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="File name inside the version folder.")
    sha256: str = Field(description="Hex sha256 of the file's bytes.")
    size: int = Field(ge=0, description="Size in bytes.")
    part_bytes: int | None = Field(None, ge=1, description="Size of the hashed parts (None: no part hashes).")
    part_sha256: list[str] = Field(
        default_factory=list, description="Hex sha256 of each part_bytes slice, in order (parallel verification)."
    )


class BaseModelRef(BaseModel):
    """The base model an adapter was validated against."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="Base model name or path as given at publish time.")
    architecture: str = Field(description="HF architecture class, e.g. Qwen3MoeForCausalLM.")


class AdapterManifest(BaseModel):
    """Everything a replica needs to fetch, verify and register one adapter version."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    adapter_id: str = Field(description="Adapter id (safe charset, unique in the store).")
    version: int = Field(ge=1, description="Version number; each publish adds last+1.")
    owner_tenant: str = Field(description="Tenant that owns the adapter.")
    base_model: BaseModelRef
    rank: int = Field(ge=1, description="LoRA rank r (largest rank for rank patterns).")
    lora_alpha: float = Field(description="LoRA alpha; scaling = alpha / r.")
    target_modules: list[str] = Field(default_factory=list, description="Module names the adapter targets (as pushed).")
    target_parameters: list[str] = Field(
        default_factory=list, description="Parameter names targeted directly (PEFT 3-D fused experts), as pushed."
    )
    has_expert_lora: bool = Field(description="Whether the adapter changes MoE expert weights.")
    layout: Literal["2d", "3d", "none"] = Field(
        description="Expert LoRA layout of the stored files: per-expert 2-D, fused 3-D, or none (no expert LoRA)."
    )
    source_layout: Literal["2d", "3d", "none"] = Field("none", description="Expert layout as pushed, before normalisation.")
    files: list[ManifestFile] = Field(description="Adapter files with sha256 and size (manifest excluded).")
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def lora_name(self) -> str:
        """This version in the slot table and in messages: ``<adapter_id>@v<version>``."""
        return f"{self.adapter_id}@v{self.version}"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def content_digest(self) -> str:
        """sha256 over the sorted (name, sha256) pairs: the cache key of this file set."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.name):
            h.update(f"{f.name}\0{f.sha256}\0{f.size}\n".encode())
        return h.hexdigest()

    def file(self, name: str) -> ManifestFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


def _first(cfg: dict, *keys: str, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


class BaseModelInfo(BaseModel):
    """Shapes of the base model's LoRA-targetable modules, read from a HF ``config.json``.

    Module shapes are ``(in_features, out_features)`` of the linear map ``y = x W^T``
    (``W [out, in]``), keyed by the module's leaf name (``q_proj``, ``gate_proj`` …).
    Expert shapes are per expert; ``num_experts == 0`` means a dense model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="Model name or path.")
    architecture: str = Field(description="architectures[0] of config.json.")
    model_type: str = Field("", description="config.json model_type.")
    hidden_size: int
    intermediate_size: int = Field(description="Dense MLP intermediate size.")
    moe_intermediate_size: int = Field(0, description="Per-expert intermediate size (0: dense model).")
    num_experts: int = Field(0, description="Routed experts per MoE layer (0: dense).")
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dense_mlp_layers: list[int] = Field(default_factory=list, description="Layers with a dense MLP in an MoE model.")
    gate_up_interleaved: bool = Field(
        False, description="Fused gate_up rows interleaved (GPT-OSS) instead of [gate; up] halves (Qwen3-MoE)."
    )

    @classmethod
    def from_config(cls, cfg: dict, name: str = "") -> "BaseModelInfo":
        """Build from a parsed ``config.json`` (text configs of multimodal models are not handled)."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            num_experts = int(_first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0))
            inter = int(_first(cfg, "intermediate_size", default=0))
            moe_inter = int(_first(cfg, "moe_intermediate_size", default=inter if num_experts else 0))
            model_type = str(cfg.get("model_type", ""))
            dense_layers = [int(x) for x in cfg.get("mlp_only_layers") or []]
            return cls(
                name=name or str(cfg.get("_name_or_path", "")),
                architecture=str((cfg.get("architectures") or [model_type or "unknown"])[0]),
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=inter,
                moe_intermediate_size=moe_inter if num_experts else 0,
                num_experts=num_experts,
                num_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
                head_dim=int(_first(cfg, "head_dim", default=hidden // heads)),
                dense_mlp_layers=dense_layers,
                gate_up_interleaved=model_type == "gpt_oss",
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterInvalid(f"base model config {name!r} lacks a usable field: {e}") from e

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "BaseModelInfo":
        """Read ``<path>/config.json`` of a Hugging Face model folder."""
        p = Path(path)
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise AdapterInvalid(f"cannot read base model config {p / 'config.json'}: {e}") from e
        return cls.from_config(cfg, name=str(path))

    @classmethod
    def from_model(cls, model: str) -> "BaseModelInfo":
        """A local HF folder, or a hub id whose config is already in the local HF cache (no download
        when ``HF_HUB_OFFLINE=1``)."""
        if (Path(model).expanduser() / "config.json").is_file():
            return cls.from_model_dir(Path(model).expanduser())
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model).to_dict()
        except Exception as e:  # noqa: BLE001 - any failure means: no config to validate against
            raise AdapterInvalid(
                f"cannot read the base model config of {model!r} ({type(e).__name__}: {e}); "
                "pass a local model folder"
            ) from e
        return cls.from_config(cfg, name=model)

    @property
    def ref(self) -> BaseModelRef:
        return BaseModelRef(name=self.name, architecture=self.architecture)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of each 2-D LoRA-targetable module; expert modules are per expert."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
        }
        if self.intermediate_size:
            shapes.update(
                gate_proj=(self.hidden_size, self.intermediate_size),
                up_proj=(self.hidden_size, self.intermediate_size),
                down_proj=(self.intermediate_size, self.hidden_size),
            )
        return shapes

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` per expert: 2-D names and the fused 3-D parameter names."""
        if not self.num_experts:
            return {}
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and layer not in self.dense_mlp_layers
