"""The restack of a 3-D MoE adapter's experts into a pinned block (``kernels.vllm.expert_restack``)
against vLLM's own merge pass (``LoRAModelManager._create_merged_loras_inplace``) on the same
adapter, and a pooled preparation (``kernels.vllm.lora_loads``) that uses it. The region is
pageable here (no CUDA); the layouts and the block's bookkeeping do not depend on page-locking."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from kernels.vllm import expert_restack, lora_loads, lora_pinning, pinned_region
from kernels.vllm.pinned_region import PinnedRegion
from tests.helpers.lora_models import moe_3d_lora_model, moe_3d_manager


def _vllms_merge(manager, model) -> None:
    from vllm.lora.model_manager import LoRAModelManager

    setattr(model, lora_pinning.MARK, lora_pinning.PREPARING)  # where loraplex's wrapper is installed: no pinning
    LoRAModelManager._create_merged_loras_inplace(manager, model)


def _flat(model) -> dict[str, list]:
    """Per module: its A and B tensors (None gaps kept) and its scaling."""
    out = {}
    for name, lora in model.loras.items():
        sides = [s if isinstance(s, list) else [s] for s in (lora.lora_a, lora.lora_b)]
        out[name] = [*sides[0], *sides[1], lora.scaling]
    return out


def _assert_same(got_model, want_model) -> None:
    """Same modules, each with the same tensors (shape, dtype, values; gaps kept) and scaling."""
    got, want = _flat(got_model), _flat(want_model)
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for a, b in zip(got[name], want[name]):
            if isinstance(b, torch.Tensor):
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), name
            else:
                assert a == b, name


def _distinct(model) -> list[torch.Tensor]:
    return lora_pinning.host_tensors(model)


@pytest.mark.parametrize("ep_size,ep_rank", [(1, 0), (2, 1)])
def test_the_restack_into_a_block_equals_vllms_merge_pass(ep_size, ep_rank):
    manager = moe_3d_manager(ep_size=ep_size, ep_rank=ep_rank)
    ours, theirs = moe_3d_lora_model(), moe_3d_lora_model()
    _vllms_merge(manager, theirs)
    region = PinnedRegion(1 << 20, pin=False)
    block = region.block(pinned_region.footprint(_distinct(ours)))
    written = expert_restack.restack_into(manager, ours, block)
    _vllms_merge(manager, ours)  # packs q/k/v, scales attention B; leaves the stacked experts
    copied = region.adopt(ours, block)
    block.close()
    _assert_same(ours, theirs)
    experts = ours.loras["model.layers.0.mlp.experts"]
    assert experts.lora_a[0] is ours.loras["model.layers.0.mlp.experts.base_layer"].lora_a  # held twice, as vLLM does
    assert experts.lora_a[0].shape == (4 // ep_size, 4, 24)
    assert all(region.holds(t) for t in _distinct(ours))
    expert_bytes = sum(t.numel() * t.element_size() for name, lora in ours.loras.items() if name.endswith("experts")
                       for t in lora.lora_a + lora.lora_b)
    assert written == expert_bytes
    assert copied == sum(t.numel() * t.element_size() for t in _distinct(ours)) - expert_bytes  # attention only


def test_the_block_returns_to_the_region_when_the_adapter_goes():
    manager = moe_3d_manager()
    model = moe_3d_lora_model()
    region = PinnedRegion(1 << 20, pin=False)
    block = region.block(pinned_region.footprint(_distinct(model)))
    expert_restack.restack_into(manager, model, block)
    _vllms_merge(manager, model)
    region.adopt(model, block)
    block.close()
    assert region.free_bytes() < region.nbytes
    del model
    gc.collect()
    assert region.free_bytes() == region.nbytes


def test_a_block_too_small_raises_and_leaves_the_module_to_vllm():
    manager = moe_3d_manager(layers=1)
    model = moe_3d_lora_model(layers=1)
    before = dict(model.loras["model.layers.0.mlp.experts"].__dict__)
    region = PinnedRegion(1 << 20, pin=False)
    block = region.block(1024)
    with pytest.raises(ValueError, match="left"):
        expert_restack.restack_into(manager, model, block)
    block.close()
    gc.collect()
    assert model.loras["model.layers.0.mlp.experts"].lora_a is before["lora_a"]
    assert region.free_bytes() == region.nbytes  # the views taken went with the failure


def test_a_2d_moe_manager_restacks_nothing():
    manager = moe_3d_manager()
    manager._is_3d_moe_model = False
    model = moe_3d_lora_model()
    region = PinnedRegion(1 << 20, pin=False)
    block = region.block(1 << 16)
    assert expert_restack.restacked_modules(manager) == [] and expert_restack.restack_into(manager, model, block) == 0
    block.close()


def test_a_pooled_preparation_restacks_straight_into_the_region(monkeypatch, caplog):
    """``lora_loads._prepare`` with ``pooled`` for a 3-D MoE model on a host that can page-lock
    (simulated: a "pinning" that copies): one block holds the adapter, written once, equal to
    what vLLM's pass makes, and nothing is pinned on top."""
    manager = moe_3d_manager()
    model, reference = moe_3d_lora_model(), moe_3d_lora_model()
    _vllms_merge(manager, reference)
    region = PinnedRegion(1 << 20, pin=False)
    pins = []
    monkeypatch.setattr(pinned_region, "_region", region)
    monkeypatch.setattr(lora_pinning, "_pin_available", True)
    monkeypatch.setattr(lora_pinning, "_pin_tensor", lambda t: pins.append(t) or t.clone())
    monkeypatch.setattr(lora_loads, "_original_load", lambda worker_manager, request: model)
    worker_manager = types.SimpleNamespace(_adapter_manager=manager)
    request = types.SimpleNamespace(lora_name="moe", lora_int_id=3)
    with caplog.at_level("INFO", logger="vllm.loraplex"):
        assert lora_loads._prepare(worker_manager, request, 0, lora_pinning.POOLED) is model
    assert "restack into the pinned region" in caplog.text
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED and pins == []
    assert all(region.holds(t) for t in _distinct(model))
    used = region.nbytes - region.free_bytes()
    assert used == pinned_region.footprint(_distinct(model))  # one block
    _assert_same(model, reference)
