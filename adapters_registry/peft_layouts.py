"""PEFT MoE-expert LoRA layouts and the exact conversion from the fused 3-D to the per-expert 2-D one.

Two layouts exist for LoRA on MoE experts (PEFT 0.21.2, transformers 5):

- **fused 3-D** (``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``): one
  LoRA pair per expert *stack*. For a parameter ``[E, out, in]`` PEFT stores ``lora_A [E·r, in]``
  expert-major (row ``e·r + j``) and ``lora_B [out, r·E]`` rank-major (column ``j·E + e``), so
  ``ΔW_e = scaling · B[:, :, e] @ A[e]`` with ``A = lora_A.reshape(E, r, in)`` and
  ``B = lora_B.reshape(out, r, E)`` (``ParamWrapper.get_delta_weight``). Several parameters of one
  module nest wrappers: the first parameter the module registers is innermost, so its keys carry
  the most ``base_layer.`` segments, e.g. ``mlp.experts.base_layer.lora_A.weight`` (gate_up_proj)
  and ``mlp.experts.lora_A.weight`` (down_proj). ``gate_up_proj`` rows are ``[gate; up]``.
- **per-expert 2-D** (``mlp.experts.{e}.gate_proj|up_proj|down_proj``): one ordinary LoRA pair
  per expert projection; what vLLM's Qwen3-MoE loads by default.

``fused_to_per_expert`` converts the first into the second exactly (pure slicing, no arithmetic):
``gate_proj``/``up_proj`` of expert e both get ``A[e]`` and the gate/up row halves of
``B[:, :, e]``; ``down_proj`` gets ``A[e]`` and ``B[:, :, e]``. Rank, alpha and scaling are unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

GATE_UP = "gate_up_proj"
DOWN = "down_proj"
# Registration order of the fused expert parameters in transformers' MoE expert modules
# (Qwen3-MoE, GPT-OSS): the innermost PEFT wrapper belongs to the first of these that is targeted.
FUSED_PARAM_ORDER = (GATE_UP, DOWN)
PER_EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_FUSED_KEY = re.compile(
    r"^(?P<prefix>.*\.experts)(?P<nest>(?:\.base_layer)*)\.(?P<ab>lora_A|lora_B)\.weight$"
)


class AdapterLayoutError(ValueError):
    """An adapter's expert LoRA does not follow the layout its config declares."""


def fused_expert_targets(config: dict) -> list[str]:
    """The fused expert parameters (``gate_up_proj``/``down_proj``) a PEFT config targets, in
    registration order; empty for adapters without 3-D expert LoRA."""
    names = {str(t).rsplit(".", 1)[-1] for t in (config.get("target_parameters") or [])}
    unknown = names - set(FUSED_PARAM_ORDER)
    if unknown:
        raise AdapterLayoutError(f"unsupported target_parameters {sorted(unknown)}")
    return [p for p in FUSED_PARAM_ORDER if p in names]


def is_fused_expert_adapter(config: dict) -> bool:
    """True if the PEFT config carries fused 3-D expert LoRA (``target_parameters``)."""
    return bool(fused_expert_targets(config))


def has_expert_lora(config: dict, tensor_names: list[str] | None = None) -> bool:
    """True if the adapter has LoRA on MoE experts, in either layout.

    Looks at ``target_parameters`` and ``target_modules`` of the config and, when given, at the
    tensor names (``.experts.`` in a LoRA key).
    """
    if is_fused_expert_adapter(config):
        return True
    if tensor_names is not None:
        return any(".experts." in n and ".lora_" in n for n in tensor_names)
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex
        return "expert" in targets
    return any("expert" in str(t) for t in targets)


def fused_to_per_expert(
    tensors: dict[str, torch.Tensor], config: dict, gate_up_interleaved: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """Converts fused 3-D expert LoRA tensors to per-expert 2-D ones; returns (tensors, config).

    ``tensors``: the adapter's state dict (PEFT key names). Keys that are not fused expert LoRA
    pass through unchanged. The returned config has ``target_parameters`` removed and the
    per-expert module names added to ``target_modules``. Raises ``AdapterLayoutError`` on shapes
    that do not fit the declared layout. ``gate_up_interleaved``: the fused ``gate_up_proj`` rows
    alternate gate/up (GPT-OSS) instead of ``[gate; up]`` halves (Qwen3-MoE and most others).
    """
    targets = fused_expert_targets(config)
    if not targets:
        return dict(tensors), dict(config)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        patterns = {**(config.get("rank_pattern") or {}), **(config.get("alpha_pattern") or {})}
        if any("expert" in k for k in patterns):
            raise AdapterLayoutError("rank_pattern/alpha_pattern on fused experts is not supported")
    r = int(config["r"])
    out: dict[str, torch.Tensor] = {}
    wrappers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        m = _FUSED_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        depth = m.group("nest").count(".base_layer")
        wrappers.setdefault(m.group("prefix"), {}).setdefault(depth, {})[m.group("ab")] = value
    for prefix, by_depth in wrappers.items():
        if len(by_depth) != len(targets):
            raise AdapterLayoutError(
                f"{prefix}: {len(by_depth)} fused LoRA wrappers for targets {targets}"
            )
        # Deepest wrapper = first registered parameter.
        pairs = {
            name: by_depth[depth]
            for name, depth in zip(targets, sorted(by_depth, reverse=True))
        }
        _check_fused_shapes(prefix, pairs, r)
        out.update(_split_pairs(prefix, pairs, r, gate_up_interleaved))
    new_config = dict(config)
    new_config.pop("target_parameters", None)
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise AdapterLayoutError("target_modules as a regex cannot be combined with 3-D experts")
    added = (["gate_proj", "up_proj"] if GATE_UP in targets else []) + (
        ["down_proj"] if DOWN in targets else []
    )
    new_config["target_modules"] = sorted(set(modules) | set(added))
    return out, new_config


def _check_fused_shapes(prefix: str, pairs: dict[str, dict[str, torch.Tensor]], r: int) -> None:
    for name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterLayoutError(f"{prefix} ({name}): needs both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] % r or a.shape[0] != b.shape[1]:
            raise AdapterLayoutError(
                f"{prefix} ({name}): lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"form an [E·{r}, in] / [out, {r}·E] pair"
            )
    if GATE_UP in pairs and DOWN in pairs:
        gu_a, gu_b = pairs[GATE_UP]["lora_A"], pairs[GATE_UP]["lora_B"]
        dn_a, dn_b = pairs[DOWN]["lora_A"], pairs[DOWN]["lora_B"]
        hidden_ok = gu_a.shape[1] == dn_b.shape[0]
        inter_ok = gu_b.shape[0] == 2 * dn_a.shape[1]
        if not (hidden_ok and inter_ok):
            raise AdapterLayoutError(
                f"{prefix}: gate_up ({tuple(gu_a.shape)}, {tuple(gu_b.shape)}) and down "
                f"({tuple(dn_a.shape)}, {tuple(dn_b.shape)}) shapes disagree"
            )
    if GATE_UP in pairs and pairs[GATE_UP]["lora_B"].shape[0] % 2:
        raise AdapterLayoutError(f"{prefix}: gate_up_proj output size must be even")


def _split_pairs(
    prefix: str, pairs: dict[str, dict[str, torch.Tensor]], r: int, interleaved: bool
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, pair in pairs.items():
        a_flat, b_flat = pair["lora_A"], pair["lora_B"]
        num_experts = a_flat.shape[0] // r
        a = a_flat.reshape(num_experts, r, a_flat.shape[1])  # [E, r, in]  (expert-major)
        b = b_flat.reshape(b_flat.shape[0], r, num_experts)  # [out, r, E] (rank-major)
        for e in range(num_experts):
            b_e = b[:, :, e]
            if name == GATE_UP:
                if interleaved:
                    parts = {"gate_proj": b_e[0::2], "up_proj": b_e[1::2]}
                else:
                    half = b_e.shape[0] // 2
                    parts = {"gate_proj": b_e[:half], "up_proj": b_e[half:]}
            else:
                parts = {"down_proj": b_e}
            for module, b_part in parts.items():
                base = f"{prefix}.{e}.{module}"
                out[f"{base}.lora_A.weight"] = a[e].clone()  # gate/up must not share storage
                out[f"{base}.lora_B.weight"] = b_part.contiguous()
    return out


def convert_adapter_dir(
    src: str | Path, dst: str | Path, gate_up_interleaved: bool = False
) -> bool:
    """Writes ``src`` to ``dst`` with fused 3-D expert LoRA converted to per-expert 2-D.

    Other files are copied unchanged. Returns True if a conversion happened, False if the adapter
    had no fused expert LoRA (then ``dst`` is a plain copy). ``dst`` must not exist.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / ADAPTER_CONFIG).read_text())
    if not is_fused_expert_adapter(config):
        shutil.copytree(src, dst)
        return False
    new_tensors, new_config = fused_to_per_expert(
        load_file(str(src / ADAPTER_WEIGHTS)), config, gate_up_interleaved
    )
    shutil.copytree(src, dst)
    try:
        save_file(new_tensors, str(dst / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (dst / ADAPTER_CONFIG).write_text(json.dumps(new_config, indent=2, sort_keys=True))
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return True
