"""The page-locked region prepared adapters are copied into (``kernels.vllm.pinned_region``), on
vLLM's own ``LoRAModel`` / ``LoRALayerWeights``. This host has no CUDA: the region is pageable
here (``pin=False``); what is tested is the block bookkeeping and the copies, which do not
depend on page-locking."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.vllm import pinned_region
from kernels.vllm.pinned_region import ALIGN, PinnedRegion, aligned
from tests.helpers.lora_models import lora_tensors, small_lora_model


def _model(seed: int = 0, lora_id: int = 7):
    """B tensors of 30 rows in bfloat16: sizes that are no multiple of ``ALIGN``, two dtypes."""
    return small_lora_model(seed, lora_id=lora_id, b_rows=30, b_dtype=torch.bfloat16)


def _bytes(model) -> int:
    return sum(aligned(t.numel() * t.element_size()) for t in lora_tensors(model))


def test_blocks_are_first_fit_aligned_and_merge_when_released():
    region = PinnedRegion(10 * ALIGN, pin=False)
    a, b, c = region.allocate(1), region.allocate(ALIGN + 1), region.allocate(3 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and region.free_bytes() == 4 * ALIGN
    assert region.allocate(5 * ALIGN) is None  # no block that large is free
    region.release(b, ALIGN + 1)
    assert region.allocate(2 * ALIGN) == ALIGN  # the hole, first fit
    region.release(ALIGN, 2 * ALIGN)
    region.release(a, 1)
    region.release(c, 3 * ALIGN)
    assert region.free_bytes() == region.nbytes and region._free == [(0, region.nbytes)]  # merged back whole


def test_an_adopted_adapter_holds_views_of_one_block_with_its_values():
    region = PinnedRegion(1 << 20, pin=False)
    model = _model()
    before = [t.clone() for t in lora_tensors(model)]
    copied = region.adopt(model)
    after = lora_tensors(model)
    assert copied == sum(t.numel() * t.element_size() for t in before)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(after, before))
    base = region.buffer.data_ptr()
    starts = sorted(t.data_ptr() - base for t in after)
    assert all(0 <= s < region.nbytes and s % ALIGN == 0 for s in starts)
    assert model.loras["layers.qkv"].lora_a[1] is None  # gaps of packed modules kept
    assert region.free_bytes() == region.nbytes - _bytes(model)


def test_a_block_returns_only_when_every_view_of_it_is_gone():
    region = PinnedRegion(1 << 20, pin=False)
    model = _model()
    region.adopt(model)
    held = model.loras["layers.0.proj"].lora_a  # someone still holds one view
    del model
    gc.collect()
    assert region.free_bytes() < region.nbytes
    del held
    gc.collect()
    assert region.free_bytes() == region.nbytes


def test_no_room_leaves_the_adapter_as_it_was():
    model = _model()
    region = PinnedRegion(_bytes(model) - ALIGN, pin=False)
    before = lora_tensors(model)
    assert region.adopt(model) == 0
    assert all(a is b for a, b in zip(lora_tensors(model), before)) and region.free_bytes() == region.nbytes


def test_two_adapters_never_share_bytes_and_a_freed_block_is_reused():
    region = PinnedRegion(4 * (1 << 14), pin=False)
    first, second = _model(1, lora_id=1), _model(2, lora_id=2)
    assert region.adopt(first) and region.adopt(second)
    spans = [{(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in lora_tensors(m)}
             for m in (first, second)]
    assert all(b1 <= a2 or b2 <= a1 for a1, b1 in spans[0] for a2, b2 in spans[1])
    reference = [t.clone() for t in lora_tensors(second)]
    del first
    gc.collect()
    third = _model(3, lora_id=3)
    assert region.adopt(third)
    assert all(torch.equal(a, b) for a, b in zip(lora_tensors(second), reference))  # untouched by the reuse


def test_reserve_makes_no_region_where_nothing_can_be_page_locked():
    pinned_region.forget()
    try:
        assert pinned_region.reserve(1 << 20, pin=False) == (0, pytest.approx(0, abs=1.0))
        assert pinned_region.adopt(_model()) == 0  # prepared 'pooled' loads fall back to eager
    finally:
        pinned_region.forget()


@pytest.mark.parametrize("room", [True, False])
def test_a_pooled_preparation_copies_into_the_region_else_pins_eagerly(monkeypatch, room):
    """``lora_loads._prepare`` with ``pooled`` on a host that can page-lock (simulated: a
    "pinning" that copies): the adapter ends in the region, marked pinned; with no room, the
    preparing thread pins it itself before ``add_lora``, as ``eager`` does."""
    import types

    from kernels.vllm import lora_loads, lora_pinning

    model = _model()
    region = PinnedRegion(_bytes(model) if room else ALIGN, pin=False)
    monkeypatch.setattr(pinned_region, "_region", region)
    monkeypatch.setattr(lora_pinning, "_pin_available", True)
    monkeypatch.setattr(lora_pinning, "_pin_tensor", lambda t: t.clone())
    before = lora_tensors(model)  # held, so that no copy can be allocated where an original was
    monkeypatch.setattr(lora_loads, "_original_load", lambda manager, request: model)
    manager = types.SimpleNamespace(_adapter_manager=types.SimpleNamespace(_create_merged_loras_inplace=lambda m: None))
    request = types.SimpleNamespace(lora_name="a", lora_int_id=5)
    assert lora_loads._prepare(manager, request, 0, lora_pinning.POOLED) is model
    inside = [region.buffer.data_ptr() <= t.data_ptr() < region.buffer.data_ptr() + region.nbytes
              for t in lora_tensors(model)]
    if room:
        assert all(inside) and getattr(model, lora_pinning.MARK) == lora_pinning.PINNED
    else:
        assert not any(inside) and getattr(model, lora_pinning.MARK) == lora_pinning.PINNED
        # every tensor replaced by its "pinned" copy
        assert not {t.data_ptr() for t in before} & {t.data_ptr() for t in lora_tensors(model)}


def test_a_tensor_held_under_two_names_is_copied_once():
    """vLLM's 3-D MoE restack leaves gate_up's tensors under ``<experts>.base_layer`` and in
    ``<experts>``'s lists: one copy, both names hold the same view."""
    region = PinnedRegion(1 << 20, pin=False)
    model = _model()
    shared = model.loras["layers.0.proj"].lora_a
    model.loras["layers.qkv"].lora_a[0] = shared
    distinct = list({id(t): t for t in lora_tensors(model)}.values())
    assert region.adopt(model) == sum(t.numel() * t.element_size() for t in distinct)
    assert model.loras["layers.qkv"].lora_a[0] is model.loras["layers.0.proj"].lora_a
    assert region.holds(model.loras["layers.0.proj"].lora_a)
