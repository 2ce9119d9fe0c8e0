"""Tuned dense LoRA tiles: the tuner's choice (``benchmarks.kernels.tune_dense_lora.tune_bucket``, on a synthetic
cost surface here; timed on the GPU machine), the device file it writes, and the lookup the
engine's dense LoRA layers make (``kernels.dense_lora.configs``), falling back to the heuristic
for shapes and devices without tuned tiles."""

from __future__ import annotations

import pytest

from benchmarks.shapes import GPT_OSS_20B, RANK, SLOTS
from tests.helpers.triton_interpret import interpreter_unless_cuda

with interpreter_unless_cuda():  # these import triton: keep later Triton tests in this process
    from benchmarks.kernels.tune_dense_lora import block_ms, shrink_tiles, tune_bucket
    from kernels.dense_lora import configs as dense_lora_configs
    from kernels.dense_lora.configs import (
        dense_shape_key,
        dump_dense_config,
        layer_dense_config,
        warm_up_configs,
    )
    from kernels.dense_lora.launch import (
        DENSE_CONFIG_BUCKET_MS,
        DenseLoRAConfig,
        dense_config,
    )
    from kernels.moe_lora import configs as triton_moe_lora_configs

QKV = (*GPT_OSS_20B.qkv, RANK, SLOTS)


def test_tuner_picks_the_cheapest_tiles_of_a_cost_surface():
    # shrink cheapest at block_k 128 / split_k 4 with 8 warps and block_m 64; expand at 256
    def timer(kind, c: DenseLoRAConfig) -> float:
        if kind == "shrink":
            return (abs(c.block_k - 128) / 64 + abs(c.split_k - 4) + (c.num_warps == 4)
                    + abs(c.block_m - 64) / 32 + 10.0)
        assert (c.block_k, c.split_k) == (128, 4)  # expand runs on the best shrink's partials
        return abs(c.block_n - 256) / 64 + abs(c.block_m - 64) / 16 + 5.0

    cfg, report = tune_bucket(2048, 2880, timer)
    assert cfg == DenseLoRAConfig(block_m=64, block_k=128, split_k=4, block_n=256, num_warps=8)
    assert report["tuned_us"] == 15.0
    assert set(report) == {f"bm{bm}_w{w}" for bm in (32, 64, 128) for w in (4, 8)} | {"tuned_us"}


def test_search_space_bounds():
    assert block_ms(16) == (16,) and 128 in block_ms(8192)
    assert all(bk * sk <= 512 for bk, sk in shrink_tiles(512)) and (256, 2) in shrink_tiles(512)
    assert (256, 4) not in shrink_tiles(512)


@pytest.fixture
def device_file(tmp_path, monkeypatch):
    """A config directory holding ``dense_lora_TEST_GPU.json``; device index 0 is that GPU."""
    monkeypatch.setattr(triton_moe_lora_configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(dense_lora_configs, "device_slug_of", lambda index: "TEST_GPU")
    for fn in (triton_moe_lora_configs.load_device_file, triton_moe_lora_configs.tuned_buckets,
               layer_dense_config):
        fn.cache_clear()
    tuned = {16: DenseLoRAConfig(16, 128, 8, 128, 4), 1024: DenseLoRAConfig(64, 64, 2, 256, 8)}
    data = triton_moe_lora_configs.open_config_file(tmp_path / "dense_lora_TEST_GPU.json",
                                                    "Test GPU")
    data["shapes"][dense_shape_key(*QKV)] = {str(m): dump_dense_config(c)
                                             for m, c in tuned.items()}
    triton_moe_lora_configs.save_config_file(tmp_path / "dense_lora_TEST_GPU.json", data)
    yield tuned
    for fn in (triton_moe_lora_configs.load_device_file, triton_moe_lora_configs.tuned_buckets,
               layer_dense_config):
        fn.cache_clear()


def test_lookup_takes_the_largest_tuned_bucket_not_above_m(device_file):
    assert layer_dense_config(1, *QKV, 0) == device_file[16]  # below all: the smallest
    assert layer_dense_config(1000, *QKV, 0) == device_file[16]
    assert layer_dense_config(2048, *QKV, 0) == device_file[1024]  # within twice the largest
    # beyond it the heuristic (a file tuned for small batches says nothing about prefill)
    assert layer_dense_config(2049, *QKV, 0) == dense_config(2049, 2880, 3)
    assert layer_dense_config(8192, *QKV, 0) == dense_config(8192, 2880, 3)
    # the warm-up compiles the tuned buckets and the heuristic's beyond the tuned reach
    assert warm_up_configs(*QKV, 0) == [(16, device_file[16]), (1024, device_file[1024]),
                                        (2049, dense_config(2049, 2880, 3)),
                                        (4097, dense_config(4097, 2880, 3))]


def test_heuristic_batch_sizes_to_warm_up_past_the_tuned_reach():
    from kernels.moe_lora.configs import TUNED_REACH, untuned_ms

    heuristic = (1, 4, 16, 64, 256, 1024, 4096)
    assert untuned_ms([], heuristic) == list(heuristic)  # nothing tuned: every bucket
    assert TUNED_REACH == 2 and untuned_ms([1, 4, 16], heuristic) == [33, 64, 256, 1024, 4096]
    assert untuned_ms([1, 8192], heuristic) == []  # tuned beyond the heuristic's last bucket


def test_a_rank_without_tuned_tiles_takes_the_nearest_tuned_rank_of_its_shape(device_file):
    """An engine whose slots are of another rank than the tuned one (``max_lora_rank`` 64 over
    rank-32 adapters) runs the shape's tuned tiles, and its warm-up compiles those."""
    in_features, out_features, rank, slots = QKV
    for other in (rank * 2, rank // 2, 512):
        assert layer_dense_config(16, in_features, out_features, other, slots, 0) \
            == device_file[16]
        assert [m for m, _ in warm_up_configs(in_features, out_features, other, slots, 0)] \
            == [16, 1024, 2049, 4097]
    # other slot counts or widths are other shapes: the heuristic
    assert layer_dense_config(16, in_features, out_features, rank, slots * 2, 0) \
        == dense_config(16, in_features, len(out_features))


def test_moe_nearest_tuned_rank_prefers_the_lower_of_two_as_near(tmp_path, monkeypatch):
    from kernels.moe_lora.configs import shape_key, tuned_buckets

    monkeypatch.setattr(triton_moe_lora_configs, "CONFIG_DIR", tmp_path)
    data = triton_moe_lora_configs.open_config_file(tmp_path / "moe_lora_TEST_GPU.json", "T")
    for rank in (16, 64):
        data["shapes"][shape_key(2880, 2880, 32, 4, rank, 8)] = {"16": {"tag": rank}}
    triton_moe_lora_configs.save_config_file(tmp_path / "moe_lora_TEST_GPU.json", data)
    for fn in (triton_moe_lora_configs.load_device_file, tuned_buckets):
        fn.cache_clear()
    try:
        def tag(rank, slots=8):
            return tuned_buckets("moe_lora", "TEST_GPU",
                                 shape_key(2880, 2880, 32, 4, rank, slots)).get("16", {}).get("tag")

        assert [tag(r) for r in (8, 16, 32, 48, 64, 256)] == [16, 16, 16, 64, 64, 64]
        assert tag(32, slots=16) is None  # another slot count: not the same shape
    finally:
        for fn in (triton_moe_lora_configs.load_device_file, tuned_buckets):
            fn.cache_clear()


def test_untuned_shape_or_device_uses_the_heuristic(device_file):
    o_shape = (*GPT_OSS_20B.o, RANK, SLOTS)
    assert layer_dense_config(1616, *o_shape, 0) == dense_config(1616, GPT_OSS_20B.o[0], 1)
    assert layer_dense_config(1616, *QKV, None) == dense_config(1616, GPT_OSS_20B.hidden, 3)
    assert [m for m, _ in warm_up_configs(*o_shape, 0)] == list(DENSE_CONFIG_BUCKET_MS)


def test_a_tuner_run_is_added_to_the_shapes_provenance_not_put_in_its_place():
    from kernels.moe_lora.configs import record_run

    older = {"command": "python -m benchmarks.kernels.tune_moe_lora --ms 1,16", "date": "2026-11-28"}
    data = {"provenance": {"K": dict(older)}}
    record_run(data, "K", {"command": "python -m benchmarks.kernels.tune_moe_lora --ms 4096", "date": "2026-11-29"},
               [4096])
    record_run(data, "other", {"command": "c", "date": "d"}, [16, 1])
    runs = data["provenance"]["K"]["runs"]
    assert runs[0] == older  # the single-run record of an older file, kept
    assert runs[1]["buckets"] == [4096] and runs[1]["date"] == "2026-11-29"
    assert data["provenance"]["other"] == {"runs": [{"command": "c", "date": "d",
                                                      "buckets": [1, 16]}]}


def test_moe_lookup_falls_back_to_the_heuristic_past_the_tuned_reach(tmp_path, monkeypatch):
    """A MoE shape tuned at decode sizes only (as the Qwen3 entry is): prefill batches do not
    get the 16-token layout."""
    from kernels.moe_lora.configs import (
        default_layer_config,
        dump_layer_config,
        shape_key,
    )

    monkeypatch.setattr(triton_moe_lora_configs, "CONFIG_DIR", tmp_path)
    triton_moe_lora_configs.load_device_file.cache_clear()
    triton_moe_lora_configs.tuned_buckets.cache_clear()
    triton_moe_lora_configs._lookup.cache_clear()
    key = shape_key(2048, 768, 128, 8, 32, 8)
    tuned = default_layer_config(16, 8, 128, 8)
    data = triton_moe_lora_configs.open_config_file(tmp_path / "moe_lora_TEST_GPU.json", "T")
    data["shapes"][key] = {"16": dump_layer_config(tuned)}
    triton_moe_lora_configs.save_config_file(tmp_path / "moe_lora_TEST_GPU.json", data)
    try:
        want = triton_moe_lora_configs.parse_layer_config(dump_layer_config(tuned))
        assert triton_moe_lora_configs._lookup("TEST_GPU", key, 32) == want  # within twice 16
        assert triton_moe_lora_configs._lookup("TEST_GPU", key, 33) is None
        assert triton_moe_lora_configs._lookup("TEST_GPU", key, 8192) is None
    finally:
        triton_moe_lora_configs.load_device_file.cache_clear()
        triton_moe_lora_configs.tuned_buckets.cache_clear()
        triton_moe_lora_configs._lookup.cache_clear()


def test_fused_max_m_turns_small_batches_into_the_one_launch_form():
    """``set_fused_max_m`` (``LORAPLEX_DENSE_FUSED_MAX_M``): batches up to it get the fused form
    of their config, larger ones keep the pair; 0 turns it off again."""
    from kernels.dense_lora.configs import layer_dense_config, set_fused_max_m
    from kernels.dense_lora.launch import FUSED_BLOCK_N

    shape = (2880, (4096, 512, 512), 32, 8, None)
    try:
        set_fused_max_m(64)
        small, large = layer_dense_config(16, *shape), layer_dense_config(65, *shape)
        assert small.fused and small.block_n == FUSED_BLOCK_N and small.split_k == 1
        assert not large.fused
        set_fused_max_m(0)
        assert not layer_dense_config(16, *shape).fused
    finally:
        set_fused_max_m(0)
