"""When an adapter's host copy is pinned (``kernels.vllm.lora_pinning``), through vLLM's own merge
pass (``LoRAModelManager._create_merged_loras_inplace``, run on a manager with no packed modules),
its activation (``activate_adapter``, on a manager with no modules), ``LoRAModel`` and
``LoRALayerWeights``. This host has no CUDA, so pinning is a copy here (``_pin_tensor``): what
``Tensor.pin_memory`` returns, less the page-locking."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from kernels.vllm import lora_pinning
from kernels.vllm.patching import Patches
from tests.helpers.lora_models import lora_tensors, small_lora_model


@pytest.fixture
def pinned(monkeypatch):
    """Installed, with pinning a copy that is recorded; yields the copies made."""
    import vllm.lora.lora_model as lora_model_module
    import vllm.lora.model_manager as model_manager_module

    monkeypatch.setattr(lora_model_module, "PIN_MEMORY", True)  # as on a CUDA host
    monkeypatch.setattr(model_manager_module, "PIN_MEMORY", True)
    patches = Patches("test lora pinning")
    lora_pinning.install(patches)
    assert lora_model_module.PIN_MEMORY is False and model_manager_module.PIN_MEMORY is False
    copies: list[torch.Tensor] = []

    def pin(t):
        copy = t.clone()
        copies.append(copy)
        return copy

    monkeypatch.setattr(lora_pinning, "_pin_available", True)
    monkeypatch.setattr(lora_pinning, "_pin_tensor", pin)
    yield copies
    assert lora_pinning.drain(30)
    patches.undo()
    assert lora_model_module.PIN_MEMORY is True and model_manager_module.PIN_MEMORY is True


def _merge(model) -> None:
    import vllm.lora.model_manager as model_manager_module

    manager = types.SimpleNamespace(packed_modules={}, modules={}, is_pooling_model=False)
    model_manager_module.LoRAModelManager._create_merged_loras_inplace(manager, model)


def _activate(model, slots: int = 2) -> bool:
    """vLLM's ``activate_adapter`` on a manager of no modules with ``model`` registered: the copy
    into a slot, as ``add_lora`` makes right after the merge pass."""
    import vllm.lora.model_manager as model_manager_module

    manager = types.SimpleNamespace(_active_adapters={}, lora_index_to_id=[None] * slots, modules={},
                                    _registered_adapters={model.id: model})
    return model_manager_module.LoRAModelManager.activate_adapter(manager, model.id)


def test_vllms_own_loads_are_pinned_in_its_merge_pass(pinned):
    model = small_lora_model()
    _merge(model)  # scaling folded into B, then pinned: vLLM's order
    expected = small_lora_model()
    for lora in expected.loras.values():
        lora.optimize()
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED
    got = lora_tensors(model)
    assert len(got) == 10 and all(any(t is c for c in pinned) for t in got)  # every tensor, None entries kept
    assert all(torch.equal(a, b) for a, b in zip(got, lora_tensors(expected)))
    assert model.loras["layers.qkv"].lora_a[1] is None and model.loras["layers.qkv"].lora_b[1] is None


def test_a_preparing_merge_leaves_pinning_to_its_thread(pinned):
    model = small_lora_model()
    setattr(model, lora_pinning.MARK, lora_pinning.PREPARING)
    before = lora_tensors(model)
    _merge(model)
    assert all(a is b for a, b in zip(lora_tensors(model), before)) and pinned == []
    size, _ = lora_pinning.pin(model)  # the eager preparation: pinned by the preparing thread
    assert size == sum(t.numel() * t.element_size() for t in before) and len(pinned) == 10
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED


def test_a_deferred_adapter_is_pinned_after_its_first_activation_not_in_the_merge_pass(pinned, monkeypatch):
    model = small_lora_model()
    setattr(model, lora_pinning.MARK, lora_pinning.DEFERRED)
    before = lora_tensors(model)
    _merge(model)  # registration: nothing pinned or scheduled yet
    assert getattr(model, lora_pinning.MARK) == lora_pinning.DEFERRED and pinned == []
    scheduled = []

    def schedule(m):  # what the real one does first: mark it (a second wrapper of this process skips it)
        scheduled.append(m)
        setattr(m, lora_pinning.MARK, lora_pinning.PINNING)

    monkeypatch.setattr(lora_pinning, "schedule", schedule)
    assert _activate(model) is True  # the first copy into a slot read the pageable tensors
    assert scheduled == [model] and all(a is b for a, b in zip(lora_tensors(model), before))


def test_deferred_pinning_swaps_in_copies_while_the_adapter_is_read(pinned, monkeypatch):
    """The first activation returns with the pageable tensors; the pinning thread swaps each for
    its copy while a reader (a copy into a slot) keeps reading: it always reads the adapter's values."""
    model = small_lora_model(modules=40)
    setattr(model, lora_pinning.MARK, lora_pinning.PREPARING)
    _merge(model)
    reference = [t.clone() for t in lora_tensors(model)]
    slow = lora_pinning._pin_tensor
    monkeypatch.setattr(lora_pinning, "_pin_tensor", lambda t: (time.sleep(0.002), slow(t))[1])
    setattr(model, lora_pinning.MARK, lora_pinning.DEFERRED)
    reads, stop = [0], threading.Event()

    def read_slots():
        while not stop.is_set():
            assert all(torch.equal(a, b) for a, b in zip(lora_tensors(model), reference))
            reads[0] += 1

    reader = threading.Thread(target=read_slots)
    reader.start()
    try:
        _activate(model)  # the first activation finds a deferred adapter and schedules it
        assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNING
        assert lora_pinning.drain(30)
    finally:
        stop.set()
        reader.join()
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED and len(pinned) == len(reference)
    assert all(any(t is c for c in pinned) for t in lora_tensors(model))
    assert all(torch.equal(a, b) for a, b in zip(lora_tensors(model), reference)) and reads[0] > 0


def test_a_failed_deferred_pinning_leaves_the_adapter_pageable(pinned, monkeypatch, caplog):
    model = small_lora_model()
    setattr(model, lora_pinning.MARK, lora_pinning.DEFERRED)
    before = lora_tensors(model)

    def fail(t):
        raise RuntimeError("CUDA error: out of memory (host)")

    monkeypatch.setattr(lora_pinning, "_pin_tensor", fail)
    with caplog.at_level("ERROR", logger="vllm.loraplex"):
        lora_pinning.schedule(model)
        assert lora_pinning.drain(30)
    assert all(a is b for a, b in zip(lora_tensors(model), before))
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED
    assert "stays in pageable memory" in caplog.text


def test_without_pinnable_memory_nothing_is_copied(monkeypatch):
    monkeypatch.setattr(lora_pinning, "_pin_available", False)
    model = small_lora_model()
    before = lora_tensors(model)
    assert lora_pinning.pin(model)[0] == 0
    setattr(model, lora_pinning.MARK, lora_pinning.DEFERRED)
    lora_pinning.schedule(model)  # nothing to schedule: marked done at once
    assert getattr(model, lora_pinning.MARK) == lora_pinning.PINNED
    assert all(a is b for a, b in zip(lora_tensors(model), before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (page-locked host memory)")
def test_deferred_pinning_page_locks_every_tensor_on_a_gpu_host():
    """With CUDA: vLLM's flags say pinnable, and a deferred adapter ends page-locked, values kept."""
    patches = Patches("test lora pinning on a GPU host")
    lora_pinning.install(patches)
    try:
        assert lora_pinning._pin_available
        model = small_lora_model(modules=8)
        reference = [t.clone() for t in lora_tensors(model)]
        setattr(model, lora_pinning.MARK, lora_pinning.DEFERRED)
        lora_pinning.schedule(model)
        assert lora_pinning.drain(60)
        assert all(t.is_pinned() for t in lora_tensors(model))
        assert all(torch.equal(a, b) for a, b in zip(lora_tensors(model), reference))
    finally:
        patches.undo()


def test_a_tensor_held_under_two_names_is_pinned_once(pinned):
    model = small_lora_model()
    model.loras["layers.qkv"].lora_a[0] = model.loras["layers.0.proj"].lora_a
    size, _ = lora_pinning.pin(model)
    distinct = list({id(t): t for t in lora_tensors(small_lora_model())}.values())
    assert len(pinned) == len(distinct) - 1  # the replaced qkv A is gone; the shared one pinned once
    assert model.loras["layers.qkv"].lora_a[0] is model.loras["layers.0.proj"].lora_a
    assert size == sum(t.numel() * t.element_size() for t in pinned)
