"""Tile configs of the MoE-LoRA Triton ops, per device, layer shape and batch-size bucket.

Tuned configs live in ``kernels/configs/moe_lora_<device>.json`` (written by ``benchmarks/kernels/tune_moe_lora.py``)::

    {"device": "NVIDIA H200",
     "provenance": {<shape key>: {"runs": [{"command": ..., "date": ..., "buckets": [...]}]}},
     "shapes": {"H2880_I2880_E32_K4_r32_L8": {"16": {<layer config>}, ...}}}

A layer config holds the block size shared by the four ops, whether the expand launches with
programmatic dependent launch (``pdl``), whether rows skip the sort (``naive``, one row per block,
for tiny batches), whether the sort runs as the parallel two-launch variant (``align_parallel``,
large batches; absent: false), whether a naive layout runs each projection as one fused launch
(``fused``, ``kernels.moe_lora.fused``; absent: false), whether the gate_up expand with the
activation folded in also does the down shrink at decode sizes (``fold_down``; absent: false;
``LORAPLEX_MOE_FOLD_DOWN=1`` turns it on for every config, for measuring it) and one entry
per op::

    {"block_m": 16, "pdl": false, "naive": false, "align_parallel": false,
     "shrink13": {"block_k": 64, "split_k": 8, "num_warps": 4, "num_stages": 3},
     "expand13": {"block_n": 128, "num_warps": 4, "num_stages": 2},
     "shrink2": {...}, "expand2": {...}}

Lookup: exact device and shape (a shape tuned at other ranks only: its nearest tuned rank,
``tuned_buckets``); the bucket is the largest tuned M not above the batch's M (the smallest one
when M is below all), for batches up to ``TUNED_REACH`` times the largest tuned M. Anything else
falls back to ``default_layer_config`` (the warm-ups compile its variants for the batch sizes
past the tuned reach too).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # kernels/configs, shipped as package data
logger = logging.getLogger(__name__)
TUNED_OF_ENV = "LORAPLEX_TUNED_CONFIGS_OF"  # a device slug whose tuned files to read; none: heuristics
NUM_SMS_DEFAULT = 132
OPS = ("shrink13", "expand13", "shrink2", "expand2")


@dataclass(frozen=True)
class OpConfig:
    """One op's launch config. ``block_k``/``split_k`` apply to shrink, ``block_n`` to expand."""

    block_k: int = 64
    split_k: int = 1
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2


def shape_key(hidden: int, intermediate: int, num_experts: int, top_k: int, rank: int,
              num_slots: int) -> str:
    """Key of a layer shape in the config files."""
    return f"H{hidden}_I{intermediate}_E{num_experts}_K{top_k}_r{rank}_L{num_slots}"


def device_slug(name: str) -> str:
    """File-name form of a device name: ``NVIDIA H200`` → ``NVIDIA_H200``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def default_layer_config(num_tokens: int, top_k: int, num_experts: int, num_slots: int,
                         num_sms: int = NUM_SMS_DEFAULT) -> dict:
    """Heuristic config: enough programs to cover the SMs, split-K only while blocks are few."""
    rows = max(1, num_tokens * top_k)
    block_m = 16 if rows <= 1024 else 32 if rows <= 4096 else 64
    blocks = min(rows, num_experts * num_slots) + rows // block_m
    split_k = max(1, min(16, -(-2 * num_sms // blocks)))
    shrink = OpConfig(block_k=64, split_k=split_k, num_warps=4, num_stages=3)
    expand = OpConfig(block_n=128, num_warps=4, num_stages=2)
    return {"block_m": block_m, "pdl": False, "naive": rows <= 8, "shrink13": shrink,
            "expand13": expand, "shrink2": shrink, "expand2": expand}


def parse_layer_config(raw: dict) -> dict:
    """JSON layer config → the dict the ops take (``OpConfig`` per op)."""
    out = {"block_m": int(raw["block_m"]), "pdl": bool(raw.get("pdl", False)),
           "naive": bool(raw.get("naive", False)),
           "align_parallel": bool(raw.get("align_parallel", False)),
           "fused": bool(raw.get("fused", False)), "fold_down": bool(raw.get("fold_down", False))}
    for op in OPS:
        out[op] = OpConfig(**raw[op])
    return out


def dump_layer_config(cfg: dict) -> dict:
    """Inverse of ``parse_layer_config``."""
    out = {"block_m": cfg["block_m"], "pdl": bool(cfg.get("pdl", False)),
           "naive": bool(cfg.get("naive", False)),
           "align_parallel": bool(cfg.get("align_parallel", False)),
           "fused": bool(cfg.get("fused", False)), "fold_down": bool(cfg.get("fold_down", False))}
    for op in OPS:
        out[op] = asdict(cfg[op])
    return out


FOLD_DOWN_ENV = "LORAPLEX_MOE_FOLD_DOWN"


def folds_down(cfg: dict) -> bool:
    """Whether this config folds the down shrink into the gate_up expand (at decode sizes,
    ``kernels.moe_lora.ops.FOLD_MAX_ROWS``): the config says so, or ``LORAPLEX_MOE_FOLD_DOWN``
    is set to a true value."""
    return bool(cfg.get("fold_down")) or os.environ.get(FOLD_DOWN_ENV, "").strip().lower() in {
        "1", "true", "on", "yes"}


def open_config_file(path: Path, device_name: str, capability: tuple[int, int] | None = None) -> dict:
    """A device's config file as a dict to update (a new one if ``path`` does not exist), with the
    device's compute ``capability`` recorded where given (what ``config_slug`` matches on)."""
    data = json.loads(path.read_text()) if path.is_file() else {"device": device_name, "provenance": {}, "shapes": {}}
    if capability is not None:
        data["capability"] = list(capability)
    return data


def record_run(data: dict, shape_key: str, run: dict, buckets: list[int]) -> None:
    """Appends a tuner run (``cuda_timing.tuner_run``) and the M buckets it wrote to the shape's
    provenance, ``{"runs": [...]}``, so a run over some buckets keeps the record of the runs
    that wrote the others (an older single-run record becomes the list's first entry)."""
    provenance = data.setdefault("provenance", {})
    record = provenance.get(shape_key) or {}
    if "runs" not in record:
        record = {"runs": [record] if record else []}
    record["runs"].append(dict(run, buckets=sorted(buckets)))
    provenance[shape_key] = record


def save_config_file(path: Path, data: dict) -> None:
    """Writes a device's config file (sorted keys: stable diffs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@functools.lru_cache(maxsize=None)
def load_device_file(prefix: str, slug: str) -> dict:
    """``shapes`` of ``kernels/configs/<prefix>_<slug>.json`` (empty when there is none):
    shape key -> {M bucket (str) -> raw config}."""
    path = CONFIG_DIR / f"{prefix}_{slug}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("shapes", {})


_RANK_IN_KEY = re.compile(r"_r(\d+)_")


@functools.lru_cache(maxsize=None)
def tuned_buckets(prefix: str, slug: str, key: str) -> dict:
    """The tuned M buckets of shape ``key`` in the device's ``<prefix>`` file; for a shape tuned
    only at other ranks, those of its nearest tuned rank (the lower of two as near). Tiles follow
    the input and output widths and M; the rank only sizes a tile's rank axis, and the ops read
    each slot up to its adapter's rank, so an engine whose ``max_lora_rank`` (64) is above the
    adapters' (32) runs best on the tiles tuned at theirs, not on the untuned heuristic."""
    shapes = load_device_file(prefix, slug)
    found = _RANK_IN_KEY.search(key)
    if key in shapes or found is None:
        return shapes.get(key, {})
    rank, shape = int(found.group(1)), _RANK_IN_KEY.sub("_r_", key)
    near = []  # (distance in doublings, tuned rank, its key) of the same shape's tuned ranks
    for other in shapes:
        if _RANK_IN_KEY.sub("_r_", other) == shape:
            tuned = int(_RANK_IN_KEY.search(other).group(1))
            near.append((abs(math.log2(tuned / rank)), tuned, other))
    return shapes[min(near)[2]] if near else {}


# A batch above a shape's largest tuned bucket takes that bucket's config up to this many times
# its M; larger batches get the heuristic (a file tuned for decode sizes only says nothing
# about prefill: a 16-token config at 8192 tokens would run a 16-row block layout).
TUNED_REACH = 2


def pick_bucket(buckets: dict, num_tokens: int):
    """The entry of the largest M bucket not above ``num_tokens`` (the smallest bucket's when
    ``num_tokens`` is below all); None when there is none or ``num_tokens`` is beyond
    ``TUNED_REACH`` times the largest."""
    if not buckets:
        return None
    ms = sorted(int(m) for m in buckets)
    if num_tokens > TUNED_REACH * ms[-1]:
        return None
    below = [m for m in ms if m <= num_tokens]
    return buckets[str(below[-1] if below else ms[0])]


def untuned_ms(tuned_ms, heuristic_ms) -> list[int]:
    """The batch sizes to warm the heuristic up at for a shape tuned at ``tuned_ms``
    (``heuristic_ms``: one M per heuristic bucket, the last standing for all larger batches):
    all of them when nothing is tuned, else the first M past the tuned reach and those beyond
    it — none when the tuned buckets reach past the heuristic's last."""
    if not tuned_ms:
        return list(heuristic_ms)
    reach, top = TUNED_REACH * max(tuned_ms), max(heuristic_ms)
    return sorted({m for m in (reach + 1, *heuristic_ms) if reach < m <= top})


@functools.lru_cache(maxsize=4096)
def _lookup(slug: str, key: str, num_tokens: int) -> dict | None:
    raw = pick_bucket(tuned_buckets("moe_lora", slug, key), num_tokens)
    return None if raw is None else parse_layer_config(raw)


@functools.lru_cache(maxsize=8192)  # called per layer and step: the result is read only
def get_layer_config(num_tokens: int, *, hidden: int, intermediate: int, num_experts: int,
                     top_k: int, rank: int, num_slots: int,
                     device: torch.device | str | None = None) -> dict:
    """Tuned config for this device/shape/M bucket, or the heuristic default."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        found = _lookup(device_slug_of(index), shape_key(hidden, intermediate, num_experts,
                                                          top_k, rank, num_slots), num_tokens)
        if found is not None:
            return found
        num_sms = _num_sms_of(index)
    else:
        num_sms = NUM_SMS_DEFAULT
    return default_layer_config(num_tokens, top_k, num_experts, num_slots, num_sms)


def tuned_layer_configs(*, hidden: int, intermediate: int, num_experts: int, top_k: int,
                        rank: int, num_slots: int,
                        device: torch.device | str | None = None) -> list[tuple[int, dict]]:
    """``[(M bucket, layer config)]`` tuned for this device and shape (empty if none)."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return []
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    buckets = tuned_buckets("moe_lora", device_slug_of(index),
                            shape_key(hidden, intermediate, num_experts, top_k, rank, num_slots))
    return [(int(m), parse_layer_config(raw)) for m, raw in sorted(buckets.items(),
                                                                   key=lambda kv: int(kv[0]))]


def config_slug(own: str, capability: tuple[int, int], override: str = "") -> str:
    """The device whose tuned files serve a device named ``own`` (its slug) of compute
    ``capability``: ``override`` when given (``LORAPLEX_TUNED_CONFIGS_OF``; ``none``: no file, the
    heuristic tiles); else its own files where any ship; else those of a device of the same
    compute capability (same instruction set and shared-memory limits: an H100 reads the
    H200's), the first by name; else its own slug (no file: the heuristic tiles)."""
    if override:
        return override
    if any(CONFIG_DIR.glob(f"*_{own}.json")):
        return own
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        if tuple(data.get("capability") or ()) == tuple(capability):
            return device_slug(data["device"])
    return own


@functools.lru_cache(maxsize=None)
def device_slug_of(index: int) -> str:
    """The slug of the device whose tuned files CUDA device ``index`` reads (``config_slug``;
    logged once, cached)."""
    own = device_slug(torch.cuda.get_device_name(index))
    slug = config_slug(own, torch.cuda.get_device_capability(index), os.environ.get(TUNED_OF_ENV, "").strip())
    if slug != own:
        logger.info("CUDA device %d (%s) runs the LoRA kernels on the tuned configs of %s", index, own, slug)
    return slug


@functools.lru_cache(maxsize=None)
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
