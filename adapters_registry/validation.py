"""Adapter validation against the base model, before publish and again before load.

Checks, each failing with :class:`AdapterInvalid` naming the problem: safe ids; safetensors only
(pickle formats refused); a PEFT LoRA config the engine can apply; every tensor name maps to a
module of the base model; shapes match the module; rank ≤ ``max_lora_rank``; float dtypes;
finite values; size limits. Expert LoRA may come per expert (2-D) or fused (PEFT 3-D); the
report says which so :mod:`adapters_registry.normalise` can convert it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from .errors import AdapterInvalid
from .manifest import CONFIG_NAME, WEIGHTS_NAME, BaseModelInfo
from .safetensors_header import TensorInfo, read_header

SAFE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
FLOAT_DTYPES = {"F32", "F16", "BF16"}
KEY_RE = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")
LAYER_RE = re.compile(r"^(?P<stem>.*?)\blayers\.(?P<layer>\d+)\.(?P<rest>.+)$")
EXPERT_2D_RE = re.compile(r"^mlp\.experts\.(?P<expert>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)$")
EXPERT_3D_RE = re.compile(r"^mlp\.experts(?:\.base_layer)*$")
ATTN_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_LEAVES = {"gate_proj", "up_proj", "down_proj"}


class ValidationLimits(BaseModel):
    """Size limits of one adapter."""

    max_total_bytes: int = Field(8 * 2**30, ge=1, description="Largest adapter (all files) accepted.")
    max_config_bytes: int = Field(2**20, ge=1, description="Largest adapter_config.json accepted.")
    max_tensors: int = Field(200_000, ge=1, description="Most tensors in adapter_model.safetensors.")


def check_id(value: str, what: str = "adapter id") -> str:
    """Refuse anything but ``[A-Za-z0-9][A-Za-z0-9_.-]{0,127}`` without ``..`` (no path traversal)."""
    if not isinstance(value, str) or not SAFE_ID_RE.match(value) or ".." in value:
        raise AdapterInvalid(
            f"invalid {what} {value!r}: use 1-128 characters from A-Z a-z 0-9 _ . - , starting with a letter "
            "or digit, without '..'"
        )
    return value


@dataclass
class FusedPair:
    """One PEFT fused-expert (3-D) LoRA pair of one layer."""

    param: Literal["gate_up_proj", "down_proj"]
    key_a: str
    key_b: str
    experts_prefix: str


@dataclass
class AdapterReport:
    """What validation learned about an adapter folder."""

    config: dict
    rank: int
    lora_alpha: float
    target_modules: list[str]
    target_parameters: list[str]
    has_expert_lora: bool
    layout: Literal["2d", "3d", "none"]
    total_bytes: int
    fused: dict[int, list[FusedPair]] = field(default_factory=dict)


def _reject_pickles(src: Path) -> None:
    for p in sorted(src.iterdir()):
        if p.name.lower().endswith(PICKLE_SUFFIXES):
            raise AdapterInvalid(
                f"{p.name}: pickle-based weight files are refused (they can run code when loaded); "
                "push only adapter_config.json and adapter_model.safetensors (save_pretrained(safe_serialization=True))"
            )


def _read_config(src: Path, max_lora_rank: int, limits: ValidationLimits) -> dict:
    path = src / CONFIG_NAME
    if not path.is_file():
        raise AdapterInvalid(f"{CONFIG_NAME} missing in {src.name}: push a PEFT LoRA adapter folder")
    if path.stat().st_size > limits.max_config_bytes:
        raise AdapterInvalid(f"{CONFIG_NAME} is larger than {limits.max_config_bytes} bytes")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterInvalid(f"{CONFIG_NAME} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterInvalid(f"{CONFIG_NAME} must be a JSON object")
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterInvalid(f"{CONFIG_NAME}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"), ("lora_bias", "LoRA bias")):
        if cfg.get(flag):
            raise AdapterInvalid(f"{CONFIG_NAME}: {flag}=true ({why}) is not supported by the engine")
    if cfg.get("modules_to_save"):
        raise AdapterInvalid(f"{CONFIG_NAME}: modules_to_save {cfg['modules_to_save']} is not supported (full-weight modules)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterInvalid(f"{CONFIG_NAME}: r must be a positive integer, got {r!r}")
    ranks = [r, *[v for v in (cfg.get("rank_pattern") or {}).values()]]
    if any(not isinstance(x, int) or x < 1 for x in ranks):
        raise AdapterInvalid(f"{CONFIG_NAME}: rank_pattern values must be positive integers")
    if max(ranks) > max_lora_rank:
        raise AdapterInvalid(f"{CONFIG_NAME}: rank {max(ranks)} exceeds the engine's max_lora_rank {max_lora_rank}")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterInvalid(f"{CONFIG_NAME}: lora_alpha must be a positive finite number, got {alpha!r}")
    return cfg


def _as_list(v) -> list[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else [str(x) for x in v]


def _check_2d_pair(name: str, a: TensorInfo, b: TensorInfo, shape_in_out: tuple[int, int], max_rank: int) -> int:
    d_in, d_out = shape_in_out
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise AdapterInvalid(f"{name}: LoRA weights must be 2-D, got A{list(a.shape)} B{list(b.shape)}")
    r = a.shape[0]
    if a.shape != (r, d_in) or b.shape != (d_out, r):
        raise AdapterInvalid(
            f"{name}: shapes A{list(a.shape)} B{list(b.shape)} do not fit the base module "
            f"(expected A[r, {d_in}] B[{d_out}, r]): adapter trained for another base model?"
        )
    if r > max_rank:
        raise AdapterInvalid(f"{name}: rank {r} exceeds the engine's max_lora_rank {max_rank}")
    return r


def _check_fused(layer: int, group: str, a: TensorInfo, b: TensorInfo, base: BaseModelInfo, max_rank: int) -> FusedPair:
    e_ = base.num_experts
    shapes = base.expert_shapes()
    candidates = []
    for param in ("gate_up_proj", "down_proj"):
        d_in, d_out = shapes[param]
        if (len(a.shape) == 2 and len(b.shape) == 2 and a.shape[1] == d_in and b.shape[0] == d_out
                and a.shape[0] % e_ == 0 and a.shape[0] == b.shape[1]):
            candidates.append(param)
    if len(candidates) != 1:
        raise AdapterInvalid(
            f"{group}: fused expert LoRA shapes A{list(a.shape)} B{list(b.shape)} match "
            f"{'no' if not candidates else 'more than one'} expert parameter of the base model "
            f"({e_} experts, gate_up (in, out)={shapes['gate_up_proj']}, down={shapes['down_proj']})"
        )
    r = a.shape[0] // e_
    if r > max_rank:
        raise AdapterInvalid(f"{group}: rank {r} exceeds the engine's max_lora_rank {max_rank}")
    prefix = a.name.split(".mlp.experts")[0] + ".mlp.experts"
    return FusedPair(candidates[0], a.name, b.name, prefix)  # type: ignore[arg-type]


def inspect_adapter(
    src_dir: str | Path,
    base: BaseModelInfo,
    max_lora_rank: int = 64,
    limits: ValidationLimits | None = None,
    check_values: bool = True,
) -> AdapterReport:
    """Validate a PEFT adapter folder against ``base``; raise :class:`AdapterInvalid` on the first problem."""
    limits = limits or ValidationLimits()
    src = Path(src_dir)
    if not src.is_dir():
        raise AdapterInvalid(f"{src}: not a directory")
    _reject_pickles(src)
    cfg = _read_config(src, max_lora_rank, limits)
    weights = src / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterInvalid(f"{WEIGHTS_NAME} missing: only safetensors weights are accepted")
    total = weights.stat().st_size + (src / CONFIG_NAME).stat().st_size
    if total > limits.max_total_bytes:
        raise AdapterInvalid(f"adapter is {total} bytes, over the limit of {limits.max_total_bytes} bytes")
    tensors = read_header(weights, WEIGHTS_NAME)
    if not tensors:
        raise AdapterInvalid(f"{WEIGHTS_NAME} holds no tensors")
    if len(tensors) > limits.max_tensors:
        raise AdapterInvalid(f"{WEIGHTS_NAME} holds {len(tensors)} tensors, over the limit of {limits.max_tensors}")

    groups: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        m = KEY_RE.match(name)
        if not m:
            raise AdapterInvalid(f"tensor {name!r} is not a PEFT LoRA weight (base_model.model.<module>.lora_A|B.weight)")
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterInvalid(f"tensor {name!r} has dtype {info.dtype}; use float32, float16 or bfloat16")
        groups.setdefault(m["path"], {})[m["ab"]] = info

    module_shapes, expert_shapes = base.module_shapes(), base.expert_shapes()
    fused: dict[int, list[FusedPair]] = {}
    has_2d_experts = False
    for path, pair in sorted(groups.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterInvalid(f"module {path!r} has lora_{''.join(pair)} but not both lora_A and lora_B")
        lm = LAYER_RE.match(path)
        if not lm:
            raise AdapterInvalid(f"module {path!r} is not inside a decoder layer; only attention/MLP/expert LoRA is served")
        layer, rest = int(lm["layer"]), lm["rest"]
        if layer >= base.num_layers:
            raise AdapterInvalid(f"module {path!r}: layer {layer} does not exist (base has {base.num_layers} layers)")
        a, b = pair["A"], pair["B"]
        if em := EXPERT_2D_RE.match(rest):
            if not base.is_moe_layer(layer) or int(em["expert"]) >= base.num_experts:
                raise AdapterInvalid(f"module {path!r}: no such expert in the base model ({base.num_experts} experts)")
            _check_2d_pair(path, a, b, expert_shapes[em["leaf"]], max_lora_rank)
            has_2d_experts = True
        elif EXPERT_3D_RE.match(rest):
            if not base.is_moe_layer(layer):
                raise AdapterInvalid(f"module {path!r}: layer {layer} has no experts in the base model")
            fused.setdefault(layer, []).append(_check_fused(layer, path, a, b, base, max_lora_rank))
        else:
            parent, _, leaf = rest.rpartition(".")
            ok = (parent == "self_attn" and leaf in ATTN_LEAVES) or (
                parent == "mlp" and leaf in MLP_LEAVES and not base.is_moe_layer(layer) and base.intermediate_size
            )
            if not ok:
                raise AdapterInvalid(f"module {path!r} is not a LoRA-targetable module of {base.architecture}")
            _check_2d_pair(path, a, b, module_shapes[leaf], max_lora_rank)
    for layer, pairs in fused.items():
        if len({p.param for p in pairs}) != len(pairs):
            raise AdapterInvalid(f"layer {layer}: two fused expert LoRA pairs target the same parameter")
    if fused and has_2d_experts:
        raise AdapterInvalid("adapter mixes per-expert (2-D) and fused (3-D) expert LoRA; use one layout")

    if check_values:
        check_finite(weights)
    layout = "3d" if fused else "2d" if has_2d_experts else "none"
    return AdapterReport(
        config=cfg,
        rank=max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()]),
        lora_alpha=float(cfg["lora_alpha"]),
        target_modules=_as_list(cfg.get("target_modules")),
        target_parameters=_as_list(cfg.get("target_parameters")),
        has_expert_lora=layout != "none",
        layout=layout,
        total_bytes=total,
        fused=fused,
    )


def check_finite(weights: Path) -> None:
    """Load tensors one by one (safetensors, no pickle) and refuse NaN/Inf."""
    import torch
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if not bool(torch.isfinite(t).all()):
                raise AdapterInvalid(f"tensor {name!r} contains NaN or Inf values")
