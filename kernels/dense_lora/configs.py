"""Tile configs of the dense LoRA Triton ops per device, layer shape and batch-size bucket.

Tuned configs live in ``kernels/configs/dense_lora_<device>.json`` (written by
``benchmarks/kernels/tune_dense_lora.py``)::

    {"device": "NVIDIA H200",
     "provenance": {<shape key>: {"runs": [{"command": ..., "date": ..., "buckets": [...]}]}},
     "shapes": {"K2880_N4096-512-512_r32_L8": {"16": {"block_m": 16, "block_k": 128,
                                                      "split_k": 8, "block_n": 128,
                                                      "num_warps": 4}, ...}}}

The shape key names the input features, each slice's output features, the rank and the slot
count. A config with ``"fused": true`` runs shrink and expand as one launch; ``LORAPLEX_DENSE_FUSED_MAX_M=N``
(default 0) makes every batch of at most N tokens use that form (``fused_form`` of its config),
for measuring it in an engine before a tuned file says so. Lookup as for the MoE-LoRA configs: exact device and shape (or the shape's nearest tuned
rank), the largest tuned M not above the batch's (the smallest when M is below all). A shape
without tuned configs uses the heuristic
``kernels.dense_lora.launch.dense_config``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import asdict

from kernels.dense_lora.launch import (
    DENSE_CONFIG_BUCKET_MS,
    DenseLoRAConfig,
    dense_config,
    fused_form,
)
from kernels.moe_lora.configs import (
    device_slug_of,
    pick_bucket,
    tuned_buckets,
    untuned_ms,
)

PREFIX = "dense_lora"
FUSED_MAX_M_ENV = "LORAPLEX_DENSE_FUSED_MAX_M"
_fused_max_m = int(os.environ.get(FUSED_MAX_M_ENV, "0") or 0)


def set_fused_max_m(m: int) -> None:
    """Batches of at most ``m`` tokens run the fused form (0: only where a tuned config says)."""
    global _fused_max_m
    _fused_max_m = m
    layer_dense_config.cache_clear()


def dense_shape_key(in_features: int, out_features: Sequence[int], rank: int,
                    num_slots: int) -> str:
    """Key of a dense LoRA layer shape in the config files."""
    return f"K{in_features}_N{'-'.join(str(n) for n in out_features)}_r{rank}_L{num_slots}"


def dump_dense_config(cfg: DenseLoRAConfig) -> dict:
    """``DenseLoRAConfig`` → its JSON form (inverse: ``DenseLoRAConfig(**raw)``)."""
    return asdict(cfg)


def _tuned(device_index: int | None, key: str) -> dict:
    if device_index is None:
        return {}
    return tuned_buckets(PREFIX, device_slug_of(device_index), key)


@functools.lru_cache(maxsize=4096)  # per layer call: a cache hit
def layer_dense_config(m: int, in_features: int, out_features: tuple[int, ...], rank: int,
                       num_slots: int, device_index: int | None) -> DenseLoRAConfig:
    """The config of ``m`` tokens for this shape on CUDA device ``device_index`` (None: not a
    CUDA device): tuned if the device's file has the shape, else the heuristic."""
    raw = pick_bucket(_tuned(device_index, dense_shape_key(in_features, out_features, rank,
                                                           num_slots)), m)
    cfg = dense_config(m, in_features, len(out_features)) if raw is None else DenseLoRAConfig(**raw)
    return fused_form(cfg) if m <= _fused_max_m and not cfg.fused else cfg


def warm_up_configs(in_features: int, out_features: tuple[int, ...], rank: int, num_slots: int,
                    device_index: int | None) -> list[tuple[int, DenseLoRAConfig]]:
    """``[(M, config)]`` covering every config a batch of this shape can get: the tuned buckets,
    and one M per heuristic bucket beyond the tuned reach (all of them when nothing is tuned)."""
    key = dense_shape_key(in_features, out_features, rank, num_slots)
    tuned = sorted(int(m) for m in _tuned(device_index, key))
    ms = tuned + untuned_ms(tuned, DENSE_CONFIG_BUCKET_MS)
    return [(m, layer_dense_config(m, in_features, out_features, rank, num_slots, device_index))
            for m in ms]
