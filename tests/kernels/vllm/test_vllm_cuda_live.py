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
    monkeypatch.setattr(live, "_ranks", {})
    monkeypatch.setattr(live, "_step", {"slots": None})


def stacks():
    """First A stacks of a q/k/v, a router and an experts module as vLLM lays them out:
    ``[L, 1, r, in]`` and ``[L, E, r, in]``, 4 slots, rank 32."""
    return torch.zeros(4, 1, 32, 8), torch.zeros(4, 1, 32, 8), torch.zeros(4, 3, 32, 8)


def manager_with(attn, router, experts):
    """A stand-in LoRA manager: three modules (q/k/v, router, experts) and the LoRA weights
    each adapter carries for them (adapter id -> module name -> weights, rank 8 or 16; the
    q/k/v ones packed in vLLM's way, a list of per-projection ``A [r, in]``; the experts'
    ``A [E, r, in]``)."""
    modules = {"qkv": SimpleNamespace(lora_a_stacked=(attn, attn)),
               "router": SimpleNamespace(lora_a_stacked=(router,)),
               "experts": SimpleNamespace(w13_lora_a_stacked=(experts,), lora_a_stacked=[]),
               "norm": SimpleNamespace()}

    def weights(rank, packed=False):
        return SimpleNamespace(rank=rank, lora_a=[torch.zeros(rank, 8), None] if packed
                               else torch.zeros(3, rank, 8))  # the experts' [E, r, in]

    carries = {7: {"qkv": weights(8, packed=True), "experts": weights(8)},
               8: {"qkv": weights(16, packed=True)}, 9: {}}
    return SimpleNamespace(modules=modules, _get_lora_layer_weights=lambda lora, name: (
        carries[lora.id].get(name)))


def test_modules_without_weights_in_the_step_are_skipped():
    attn, router, experts = stacks()
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
    assert not live.skippable(torch.zeros(4, 1, 32, 8))  # an untracked module: never skipped


def test_all_tokens_covered_only_when_every_token_is_on_a_slot_with_weights():
    attn, router, experts = stacks()
    mgr = manager_with(attn, router, experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=7))  # attention + experts in slot 0
    live.record_slot(mgr, 1, SimpleNamespace(id=8))  # attention only in slot 1
    assert not live.covers_all_tokens(experts, 3)  # no step recorded yet
    live.record_step((7, 7, 7), [7, 8, None])
    assert live.covers_all_tokens(experts, 3) and live.covers_all_tokens(attn, 3)
    assert not live.covers_all_tokens(experts, 4)  # rows beyond the step's tokens (padding)
    assert not live.covers_all_tokens(router, 3)  # no slot has router weights
    assert not live.covers_all_tokens(torch.zeros(4, 1, 32, 8), 3)  # an untracked module
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

    attn, router, experts = stacks()
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


def test_modules_get_a_device_table_of_their_slots_ranks(monkeypatch):
    """The table the kernels read (inside CUDA graphs too) follows the activations, in place
    (same tensor, same address): per slot the rank of its adapter's weights for the module, 0
    where it has none; for dense and MoE modules alike."""
    attn, router, experts = stacks()
    mgr = manager_with(attn, router, experts)
    live.record_slot(mgr, 0, SimpleNamespace(id=7))
    live.record_slot(mgr, 2, SimpleNamespace(id=8))
    assert live.slot_ranks(attn) is None  # tracking not installed: no table handed out
    monkeypatch.setattr(live, "_tracking", [True])
    qkv, router_ranks, expert_ranks = (live.slot_ranks(t) for t in (attn, router, experts))
    assert qkv.tolist() == [8, 0, 16, 0] and router_ranks.tolist() == [0, 0, 0, 0]
    assert expert_ranks.tolist() == [8, 0, 0, 0] and qkv.dtype == torch.int32
    live.record_slot(mgr, 0, SimpleNamespace(id=8))  # still attention, rank 16
    live.record_slot(mgr, 2, SimpleNamespace(id=9))  # an adapter with nothing here
    assert live.slot_ranks(attn) is qkv and qkv.tolist() == [16, 0, 0, 0]
    assert live.slot_ranks(experts) is expert_ranks and expert_ranks.tolist() == [0, 0, 0, 0]


def test_a_slots_rank_is_never_below_the_rows_vllm_copies_into_it():
    """The rank the kernels read a slot to: the largest of the adapter config's ``rank`` and the
    rows of its ``A`` parts as vLLM lays them out (``[r, in]``, ``[E, r, in]``, the fused
    experts' ``[E*r, in]``), at most the stack's; anything else reads the whole stack."""
    def w(rank, *parts):
        return SimpleNamespace(rank=rank, lora_a=list(parts) if len(parts) > 1 else parts[0])

    # packed q/k/v under the first part's rank, a larger second part
    assert live.adapter_rank(w(8, torch.zeros(8, 4), None, torch.zeros(24, 4)), 32) == 24
    # a config rank below the tensors' (vLLM copies the tensor's rows): the tensors win
    assert live.adapter_rank(w(16, torch.zeros(32, 4)), 64) == 32
    assert live.adapter_rank(w(16, torch.zeros(6, 16, 4)), 64) == 16  # [E, r, in]
    assert live.adapter_rank(w(16, torch.zeros(6 * 16, 4)), 64, num_experts=6) == 16  # [E*r, in]
    assert live.adapter_rank(w(16, torch.zeros(6 * 16 + 1, 4)), 64, num_experts=6) == 64
    assert live.adapter_rank(w(16, torch.zeros(16)), 64) == 64  # an unknown layout
    assert live.adapter_rank(SimpleNamespace(rank=None, lora_a=None), 32) == 32
    assert live.adapter_rank(w(64, torch.zeros(64, 4)), 32) == 32  # never above the stack


def test_a_table_made_during_warm_up_is_written_by_a_later_add_lora():
    """vLLM activates its dummy adapters under ``torch.inference_mode`` (warm-up, graph capture)
    and a served adapter outside it (``add_lora`` through the engine's RPC): the table made in
    the first must take the writes of the second, in place."""
    attn, router, experts = stacks()
    mgr = manager_with(attn, router, experts)
    with torch.inference_mode():
        live.record_slot(mgr, 0, SimpleNamespace(id=7))
    ranks = live._ranks[attn.data_ptr()]
    assert ranks.is_inference()
    live.record_slot(mgr, 1, SimpleNamespace(id=8))  # outside inference mode
    live.record_slot(mgr, 0, SimpleNamespace(id=9))
    assert live._ranks[attn.data_ptr()] is ranks and ranks.tolist() == [0, 16, 0, 0]
