"""The tuned config files that ship in ``kernels/configs`` are the ones the lookups read: a
lookup that misses its file falls back to the heuristic without a word, so a moved module or
folder would silently drop every tuned tile (found on the H200: the shrinks ran 3-4x slower)."""

from __future__ import annotations

import json
from pathlib import Path

import kernels
from benchmarks.shapes import GPT_OSS_20B, RANK, SLOTS
from tests.helpers.triton_interpret import interpreter_unless_cuda

with interpreter_unless_cuda():
    from kernels.dense_lora.configs import dense_shape_key
    from kernels.moe_lora import configs as moe_configs

SHIPPED = Path(kernels.__file__).parent / "configs"


def test_the_lookups_read_the_folder_that_ships():
    assert moe_configs.CONFIG_DIR.resolve() == SHIPPED.resolve()
    files = sorted(p.name for p in SHIPPED.glob("*.json"))
    assert files == ["dense_lora_NVIDIA_H200.json", "moe_lora_NVIDIA_H200.json"]
    for prefix in ("moe_lora", "dense_lora"):
        on_disk = json.loads((SHIPPED / f"{prefix}_NVIDIA_H200.json").read_text())["shapes"]
        assert moe_configs.load_device_file(prefix, "NVIDIA_H200") == on_disk


def test_gpt_oss_20b_finds_its_tuned_tiles_at_every_decode_bucket():
    s = GPT_OSS_20B
    key = moe_configs.shape_key(s.hidden, s.intermediate, s.num_experts, s.top_k, RANK, SLOTS)
    for m in (1, 16, 64, 256, 1024):
        tuned = moe_configs._lookup("NVIDIA_H200", key, m)
        assert tuned is not None, f"no tuned MoE-LoRA config for {key} at M={m}"
        assert tuned != moe_configs.default_layer_config(m, s.top_k, s.num_experts, SLOTS)
    dense = moe_configs.load_device_file("dense_lora", "NVIDIA_H200")
    for in_features, out_features in (s.qkv, s.o):
        assert dense_shape_key(in_features, out_features, RANK, SLOTS) in dense


def test_deploy_h200s_slot_rank_finds_the_rank_32_tiles():
    """deploy/h200.yaml's engine has slots of rank 64 for adapters of rank 32 (and 16/64): its
    MoE and dense LoRA ops run the tiles tuned at rank 32, not the untuned heuristic."""
    s = GPT_OSS_20B
    at = {rank: moe_configs.shape_key(s.hidden, s.intermediate, s.num_experts, s.top_k, rank,
                                      SLOTS) for rank in (RANK, 64)}
    for m in (1, 16, 64, 256):
        assert moe_configs._lookup("NVIDIA_H200", at[64], m) \
            == moe_configs._lookup("NVIDIA_H200", at[RANK], m) is not None
    for in_features, out_features in (s.qkv, s.o):
        assert moe_configs.tuned_buckets("dense_lora", "NVIDIA_H200", dense_shape_key(
            in_features, out_features, 64, SLOTS)) == moe_configs.tuned_buckets(
            "dense_lora", "NVIDIA_H200", dense_shape_key(in_features, out_features, RANK, SLOTS))


def test_a_device_without_files_reads_those_of_its_architecture():
    """An H100 (compute capability 9.0, no files of its own) reads the H200's tuned tiles; a device
    of another architecture, the heuristic; a device with files, its own; the override names the
    device whose files to read (``none``: no file)."""
    slug = moe_configs.config_slug
    assert slug("NVIDIA_H100_80GB_HBM3", (9, 0)) == "NVIDIA_H200"
    assert slug("NVIDIA_H200", (9, 0)) == "NVIDIA_H200"
    assert slug("NVIDIA_A100-SXM4-80GB", (8, 0)) == "NVIDIA_A100-SXM4-80GB"
    assert slug("NVIDIA_H100_80GB_HBM3", (9, 0), override="none") == "none"
    assert moe_configs.load_device_file("moe_lora", "none") == {}
    for prefix in ("moe_lora", "dense_lora"):
        assert json.loads((SHIPPED / f"{prefix}_NVIDIA_H200.json").read_text())["capability"] == [9, 0]


def test_a_tuner_records_the_capability_of_the_device_it_tuned(tmp_path):
    data = moe_configs.open_config_file(tmp_path / "moe_lora_X.json", "X", (9, 0))
    assert data == {"device": "X", "capability": [9, 0], "provenance": {}, "shapes": {}}
