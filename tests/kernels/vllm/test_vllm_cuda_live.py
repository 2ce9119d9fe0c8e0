"""``kernels.vllm.cuda.live``: per module, the slots holding weights; per step, the slots in use;
a module is skipped only when they do not meet (and only for tracked modules)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.vllm.cuda import live


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(live, "_live", {})
    monkeypatch.setattr(live, "_masks", {})
    monkeypatch.setattr(live, "_step", {"slots": None})


def manager_with(attn, router, experts):
    """A stand-in LoRA manager: three modules (q/k/v, router, experts) and what each adapter
    carries (adapter id -> module names)."""
    modules = {"qkv": SimpleNamespace(lora_a_stacked=(attn, attn)),
               "router": SimpleNamespace(lora_a_stacked=(router,)),
               "experts": SimpleNamespace(w13_lora_a_stacked=(experts,), lora_a_stacked=[]),
               "norm": SimpleNamespace()}
    carries = {7: {"qkv", "experts"}, 8: {"qkv"}, 9: set()}
    return SimpleNamespace(modules=modules, _get_lora_layer_weights=lambda lora, name: (
        name in carries[lora.id]))


def test_modules_without_weights_in_the_step_are_skipped():
    attn, router, experts = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    mgr = manager_with(attn, router, experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=7))  # attention + experts in slot 0
    live.record_slot(mgr, 1, SimpleNamespace(id=8))  # attention only in slot 1
    assert not any(live.skippable(t) for t in (attn, router, experts))  # no step yet
    live.record_step((8, 8, 0, 8), [7, 8, None])  # tokens on adapter 8 (slot 1) or none
    assert live.skippable(router) and live.skippable(experts) and not live.skippable(attn)
    live.record_step((7, 0), [7, 8, None])
    assert live.skippable(router) and not live.skippable(experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=8))  # slot 0 reused by an attention-only one
    assert live.skippable(experts)
    assert not live.skippable(torch.zeros(4))  # an untracked module is never skipped


def test_all_tokens_covered_only_when_every_token_is_on_a_slot_with_weights():
    attn, router, experts = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    mgr = manager_with(attn, router, experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=7))  # attention + experts in slot 0
    live.record_slot(mgr, 1, SimpleNamespace(id=8))  # attention only in slot 1
    assert not live.covers_all_tokens(experts, 3)  # no step recorded yet
    live.record_step((7, 7, 7), [7, 8, None])
    assert live.covers_all_tokens(experts, 3) and live.covers_all_tokens(attn, 3)
    assert not live.covers_all_tokens(experts, 4)  # rows beyond the step's tokens (padding)
    assert not live.covers_all_tokens(router, 3)  # no slot has router weights
    assert not live.covers_all_tokens(torch.zeros(4), 3)  # an untracked module
    live.record_step((7, 0, 7), [7, 8, None])  # a token without adapter
    assert not live.covers_all_tokens(experts, 3)
    live.record_step((7, 8), [7, 8, None])  # slot 1's adapter has no expert weights
    assert not live.covers_all_tokens(experts, 2) and live.covers_all_tokens(attn, 2)
    live.record_step((7, 9), [7, 8, None])  # adapter 9 is not resident
    assert not live.covers_all_tokens(attn, 2)


def test_wrapped_activation_and_the_punica_wrapper_record_slots_and_steps(monkeypatch):
    """``activate_adapter`` (wrapped) records the slot's modules; loraplex's punica wrapper's
    ``update_metadata`` prepares the step's mapping and records the step's slots."""
    from kernels.vllm.cuda import punica

    attn, router, experts = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    mgr = manager_with(attn, router, experts)
    mgr.lora_index_to_id = [None, 7]
    mgr._registered_adapters = {7: SimpleNamespace(id=7)}
    assert live.recording_slots(lambda self, lora_id: True)(mgr, 7) is True
    prepared = []
    monkeypatch.setattr(punica, "_ours", lambda: True)
    monkeypatch.setattr(punica.mapping, "update_metadata", lambda *a: prepared.append(a))
    wrapper, step = object(), SimpleNamespace(index_mapping=(7, 7, 0))
    punica.LoraplexPunicaWrapper.update_metadata(wrapper, step, [None, 7], 9, 100)
    assert prepared == [(wrapper, step, [None, 7], 9, 100)]
    assert live._step["slots"] == frozenset({1})
    assert live.skippable(router) and not live.skippable(attn) and not live.skippable(experts)


def test_dense_modules_get_a_device_mask_of_their_live_slots(monkeypatch):
    """The mask the dense kernels read inside CUDA graphs follows the activations, in place
    (same tensor, same address); MoE modules get none (vLLM flags their slots itself)."""
    attn, router, experts = torch.zeros(4), torch.zeros(4, 2), torch.zeros(4)
    mgr = manager_with(attn, router, experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=7))
    live.record_slot(mgr, 2, SimpleNamespace(id=8))
    assert live.slot_mask(attn) is None  # tracking not installed: no mask handed out
    monkeypatch.setattr(live, "_tracking", [True])
    qkv_mask, router_mask = live.slot_mask(attn), live.slot_mask(router)
    assert qkv_mask.tolist() == [1, 0, 1, 0] and router_mask.tolist() == [0, 0, 0, 0]
    assert qkv_mask.dtype == torch.int32 and live.slot_mask(experts) is None
    live.record_slot(mgr, 0, SimpleNamespace(id=8))  # still attention
    live.record_slot(mgr, 2, SimpleNamespace(id=9))  # an adapter with nothing here
    assert live.slot_mask(attn) is qkv_mask and qkv_mask.tolist() == [1, 0, 0, 0]



def test_a_mask_made_during_warm_up_is_written_by_a_later_add_lora():
    """vLLM activates its dummy adapters under ``torch.inference_mode`` (warm-up, graph capture)
    and a served adapter outside it (``add_lora`` through the engine's RPC): the mask made in the
    first must take the writes of the second, in place."""
    attn, router, experts = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    mgr = manager_with(attn, router, experts)
    with torch.inference_mode():
        live.record_slot(mgr, 0, SimpleNamespace(id=7))
    mask = live._masks[attn.data_ptr()]
    assert mask.is_inference()
    live.record_slot(mgr, 1, SimpleNamespace(id=8))  # outside inference mode
    live.record_slot(mgr, 0, SimpleNamespace(id=9))
    assert live._masks[attn.data_ptr()] is mask and mask.tolist() == [0, 1, 0, 0]
