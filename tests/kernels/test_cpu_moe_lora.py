"""The CPU MoE-LoRA path (kernels/cpu/moe_lora.py) against the PyTorch reference, fresh inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.moe_lora import (
    MoELoRASlices,
    moe_lora_cpu,
    moe_lora_cpu_sliced,
    pair_groups,
)
from kernels.moe_math import MoELoRAWeights
from kernels.reference import moe_lora_reference, random_moe_lora_problem

# (tokens, hidden, intermediate, experts, top_k, slots)
SHAPES = [
    (1, 64, 32, 8, 2, 2),
    (7, 33, 17, 5, 1, 3),
    (37, 96, 48, 16, 4, 4),
    (64, 128, 64, 8, 8, 2),
    (130, 80, 24, 12, 6, 5),
]
RANKS = [8, 16, 32, 64]
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    scale = ref.abs().max().item()
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.double(), atol=atol * max(scale, 1.0), rtol=rtol)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_fp32(shape, rank, activation, seed):
    T, H, I, E, K, L = shape
    p = random_moe_lora_problem(
        T, H, I, E, K, L, rank, slots_without_experts=(L - 1,) if L > 2 else (), with_bias=T % 2 == 1, seed=seed
    )
    ref = moe_lora_reference(**p, activation=activation, compute_dtype=torch.float64)
    out = moe_lora_cpu(**p, activation=activation)
    _check(out, ref, torch.float32)
    # The LoRA part is not negligible: the layer without adapters differs clearly.
    tl = p["token_lora"].long()
    with_experts = (tl >= 0) & p["lora"].has_experts[tl.clamp_min(0)]
    if with_experts.any():
        base = moe_lora_reference(**{**p, "lora": None}, activation=activation)
        assert (base - ref.float())[with_experts].abs().max() > 1e-2


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_bf16(shape, rank, activation, seed):
    T, H, I, E, K, L = shape
    p = random_moe_lora_problem(T, H, I, E, K, L, rank, dtype=torch.bfloat16, slots_without_experts=(0,), seed=seed)
    ref = moe_lora_reference(**p, activation=activation, compute_dtype=torch.float64)
    out = moe_lora_cpu(**p, activation=activation)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("grouped_min_rows", [0, 10**9], ids=["grouped-gemms", "gathered-bmm"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_both_lora_strategies_match_reference(monkeypatch, grouped_min_rows, activation, seed):
    import kernels.cpu.moe_lora as cpu

    monkeypatch.setattr(cpu, "GROUPED_MIN_ROWS", grouped_min_rows)
    monkeypatch.setattr(cpu, "GATHER_MAX_ELEMENTS", 1 << 40)
    p = random_moe_lora_problem(45, 40, 24, 6, 3, 3, 16, slots_without_experts=(2,), with_bias=True, seed=seed)
    ref = moe_lora_reference(**p, activation=activation, compute_dtype=torch.float64)
    _check(cpu.moe_lora_cpu(**p, activation=activation), ref, torch.float32)


def test_tokens_without_adapter_and_slots_without_experts_get_the_base_layer(seed):
    p = random_moe_lora_problem(40, 64, 32, 8, 2, 3, 16, no_adapter_fraction=0.5, slots_without_experts=(1,), seed=seed)
    out = moe_lora_cpu(**p)
    base = moe_lora_cpu(**{**p, "lora": None})
    plain = (p["token_lora"] < 0) | (p["token_lora"] == 1)
    assert plain.any() and (~plain).any()
    torch.testing.assert_close(out[plain], base[plain], atol=1e-5, rtol=1e-5)
    assert (out[~plain] - base[~plain]).abs().amax(dim=-1).min() > 1e-4


def test_no_lora_equals_reference_base_layer(seed):
    p = random_moe_lora_problem(23, 48, 40, 6, 3, 2, 8, with_bias=True, seed=seed)
    ref = moe_lora_reference(**{**p, "lora": None}, compute_dtype=torch.float64)
    _check(moe_lora_cpu(**{**p, "lora": None}), ref, torch.float32)


def test_gate_up_slices_with_separate_a_matrices_match_reference(seed):
    """vLLM's layout: gate and up LoRA as two slices, each with its own A (silu: concatenated)."""
    T, H, I, E, K, L, r = 29, 64, 24, 6, 2, 3, 8
    p = random_moe_lora_problem(T, H, I, E, K, L, 2 * r, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    gate_a, up_a = (torch.randn(L, E, r, H, generator=g) * H**-0.5 for _ in range(2))
    gate_b, up_b = (torch.randn(L, E, I, r, generator=g) * r**-0.5 for _ in range(2))
    w13_a, w13_b = MoELoRAWeights.from_gate_up(gate_a, gate_b, up_a, up_b)
    lora = p["lora"]
    lora.w13_a, lora.w13_b = w13_a, w13_b
    ref = moe_lora_reference(**p, compute_dtype=torch.float64)
    sliced = MoELoRASlices(
        w13_a=(gate_a, up_a), w13_b=(gate_b, up_b), w2_a=lora.w2_a, w2_b=lora.w2_b,
        scaling=lora.scaling, enabled=lora.has_experts,
    )
    args = {k: p[k] for k in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w2")}
    _check(moe_lora_cpu_sliced(**args, lora=sliced), ref, torch.float32)


def test_swigluoai_slices_are_interleaved(seed):
    """With two slices and swigluoai, slice 0 feeds the even (gate) rows and slice 1 the odd ones."""
    T, H, I, E, K, L, r = 17, 32, 16, 4, 2, 2, 8
    p = random_moe_lora_problem(T, H, I, E, K, L, r, seed=seed)
    lora = p["lora"]
    gate_b, up_b = lora.w13_b[:, :, 0::2].clone(), lora.w13_b[:, :, 1::2].clone()
    ref = moe_lora_reference(**p, activation="swigluoai", compute_dtype=torch.float64)
    sliced = MoELoRASlices(
        w13_a=(lora.w13_a, lora.w13_a), w13_b=(gate_b, up_b), w2_a=lora.w2_a, w2_b=lora.w2_b,
        scaling=lora.scaling, enabled=lora.has_experts,
    )
    args = {k: p[k] for k in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w2")}
    _check(moe_lora_cpu_sliced(**args, lora=sliced, activation="swigluoai"), ref, torch.float32)


def test_shared_expert_dimension_broadcasts(seed):
    """Tensors with expert dimension 1 (vLLM's shared MoE LoRA) apply to every expert."""
    p = random_moe_lora_problem(31, 48, 16, 5, 2, 2, 8, seed=seed)
    lora = p["lora"]
    lora.w13_a[:] = lora.w13_a[:, :1]
    lora.w2_b[:] = lora.w2_b[:, :1]
    ref = moe_lora_reference(**p, compute_dtype=torch.float64)
    sliced = MoELoRASlices.from_weights(lora)
    sliced.w13_a = (lora.w13_a[:, :1].clone(),)
    sliced.w2_b = lora.w2_b[:, :1].clone()
    args = {k: p[k] for k in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w2")}
    _check(moe_lora_cpu_sliced(**args, lora=sliced), ref, torch.float32)


def test_unweighted_sum_when_router_weight_was_applied_to_input(seed):
    p = random_moe_lora_problem(9, 32, 16, 4, 1, 2, 8, seed=seed)
    args = {k: p[k] for k in ("x", "topk_ids", "token_lora", "w13", "w2", "lora")}
    ones = torch.ones_like(p["topk_weights"])
    ref = moe_lora_reference(**args, topk_weights=ones, compute_dtype=torch.float64)
    out = moe_lora_cpu_sliced(
        **{**args, "lora": MoELoRASlices.from_weights(p["lora"])},
        topk_weights=p["topk_weights"], apply_router_weight=False,
    )
    _check(out, ref, torch.float32)


def test_pair_groups_are_sorted_by_expert_then_adapter_and_cover_all_pairs():
    topk_ids = torch.tensor([[2, 0], [0, 1], [2, 1], [-1, 0]])
    token_lora = torch.tensor([1, -1, 0, 1])
    enabled = torch.tensor([True, False])  # slot 1 has no expert LoRA: its pairs count as base
    order, pair_lora, groups = pair_groups(topk_ids, token_lora, enabled)
    assert [(e, a) for e, a, _, _ in groups] == [(0, -1), (1, -1), (1, 0), (2, -1), (2, 0)]
    assert sorted(order.tolist()) == [0, 1, 2, 3, 4, 5, 7]  # pair 6 (expert -1) is dropped
    assert groups[-1][3] == order.numel()
    for e, a, s, t in groups:
        assert (topk_ids.reshape(-1)[order[s:t]] == e).all() and (pair_lora[s:t] == a).all()


def test_empty_batch(seed):
    p = random_moe_lora_problem(0, 32, 16, 4, 2, 2, 8, seed=seed)
    assert moe_lora_cpu(**p).shape == (0, 32)


def test_unknown_activation_is_refused(seed):
    p = random_moe_lora_problem(3, 32, 16, 4, 2, 2, 8, seed=seed)
    with pytest.raises(ValueError, match="activation"):
        moe_lora_cpu(**p, activation="gelu")
