"""The add_lora host profile on a real (tiny) 3-D expert adapter through vLLM's own loader: every
step timed, the restacked expert tensors in the shapes vLLM's slots take, the bytes counted."""

from __future__ import annotations

import torch

from adapters_registry.manifest import BaseModelInfo
from benchmarks.profiling.lora_load import STEPS, _restack, once
from benchmarks.synthetic_adapters import synthetic_adapter


def test_every_step_is_timed_on_a_three_d_expert_adapter(embedded_model_dir, tmp_path):
    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    folder = synthetic_adapter(tmp_path / "a", base, r=4, experts="3d", dtype="bfloat16")
    times = once(folder, base.num_experts)
    assert set(times) == {*STEPS, "bytes"} and all(times[s] >= 0 for s in STEPS)
    on_disk = (folder / "adapter_model.safetensors").stat().st_size
    assert 0.9 * on_disk < times["bytes"] <= on_disk  # every tensor counted once (the file adds a header)


def test_restack_gives_experts_first_shapes(embedded_model_dir, tmp_path):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from benchmarks.profiling.lora_load import _modules

    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    folder = synthetic_adapter(tmp_path / "a", base, r=4, experts="3d", dtype="bfloat16")
    lora = LoRAModel.from_local_checkpoint(str(folder), _modules(folder), PEFTHelper.from_local_dir(str(folder), None),
                                           lora_model_id=1, device="cpu", dtype=torch.bfloat16)
    name = next(n for n in lora.loras if n.endswith(".experts"))
    b_before = lora.loras[name].lora_b.clone()
    _restack(lora, base.num_experts)
    down = lora.loras[name]
    e = base.num_experts
    assert down.lora_a.shape[0] == e and down.lora_a.shape[1] == 4
    assert down.lora_b.shape == (e, b_before.shape[0], 4)
    # expert j's B is column block j of the flat (out, rank * experts) tensor, rank-major per expert
    assert torch.equal(down.lora_b[1], b_before.reshape(b_before.shape[0], 4, e)[:, :, 1])


def test_both_pooled_ways_end_with_the_same_tensors_in_one_block(embedded_model_dir, tmp_path):
    """``--pooled``: vLLM's restack, scale and a copy against the restack into the block: every
    step timed, the same bytes in the block, the table names both ways."""
    from benchmarks.profiling.lora_load import POOLED_STEPS, POOLED_WAYS, pooled_once, pooled_table, region_for

    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    folder = synthetic_adapter(tmp_path / "a", base, r=4, experts="3d", dtype="bfloat16")
    region = region_for(folder)
    runs = {way: pooled_once(folder, base.num_experts, way, region) for way in POOLED_WAYS}
    assert all(set(r) == {*POOLED_STEPS, "bytes"} and all(r[s] >= 0 for s in POOLED_STEPS) for r in runs.values())
    on_disk = (folder / "adapter_model.safetensors").stat().st_size
    assert runs["vllm_then_copy"]["bytes"] == runs["restack_into_block"]["bytes"]
    assert 0.9 * on_disk < runs["restack_into_block"]["bytes"] <= on_disk
    table, _ = pooled_table(folder, base.num_experts, 1)
    assert all(f"| {way} |" in table for way in POOLED_WAYS)
