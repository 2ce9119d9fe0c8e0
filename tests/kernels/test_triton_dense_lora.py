"""Triton dense LoRA ops (``kernels.dense_lora.launch``) against a float64 PyTorch reference.

Without CUDA they run under the Triton interpreter (``tests.helpers.triton_interpret``; the fresh-process
fallback of ``tests/kernels/test_triton_moe_lora.py`` also runs this file); on a GPU also at GPT-OSS-20B and
Qwen3-30B-A3B attention shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import MODELS
from tests.helpers.triton_interpret import (
    HAS_CUDA,
    interpreter_unless_cuda,
    interpreter_when_no_gpu,
    rel_err,
)

with interpreter_unless_cuda():
    from kernels.dense_lora.groups import group_tokens
    from kernels.dense_lora.launch import (
        DenseLoRAConfig,
        dense_config,
        dense_lora_expand,
        dense_lora_fused,
        dense_lora_shrink,
    )
    from kernels.dense_lora.layer import DenseLoRALayer
DEV = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("interpreter_when_no_gpu")
_ = interpreter_when_no_gpu  # the fixture, used through pytestmark


def dense_reference(y, x, lora_a, lora_b, token_lora, scale, add_inputs=True):
    """float64 ``y[t, cols_i] (+)= scale * x[t] A_i[s]^T B_i[s]^T`` for tokens with slot s >= 0."""
    out = y.double().clone()
    col = 0
    for a, b in zip(lora_a, lora_b):
        a3, b3 = a.flatten(1, 2).double(), b.flatten(1, 2).double()
        n = b3.shape[1]
        for t, s in enumerate(token_lora.tolist()):
            if s < 0:
                continue
            delta = scale * (x[t].double() @ a3[s].T) @ b3[s].T
            out[t, col:col + n] = (out[t, col:col + n] if add_inputs else 0) + delta
        col += n
    return out


def problem(m, k, ns, slots, rank, dtype, seed, no_adapter=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    a = [(torch.randn(slots, 1, rank, k, generator=g) / k**0.5).to(dtype).to(DEV) for _ in ns]
    b = [torch.randn(slots, 1, n, rank, generator=g).to(dtype).to(DEV) for n in ns]
    lora = torch.randint(0, slots, (m,), generator=g)
    lora[torch.rand(m, generator=g) < no_adapter] = -1
    lora[0] = 0
    y = torch.randn(m, sum(ns), generator=g).to(dtype).to(DEV)
    return y, x, a, b, lora.to(torch.int32).to(DEV)


# M, in, slice widths, slots, rank, config (None: the heuristic for M)
CASES = [
    (7, 40, (24, 8, 8), 3, 8, None),
    (19, 72, (48,), 4, 24, DenseLoRAConfig(block_m=16, block_k=16, split_k=3, block_n=32)),
    (33, 56, (40, 24), 3, 64, DenseLoRAConfig(block_m=16, block_k=32, split_k=2, block_n=16)),
    (70, 48, (16, 16, 16), 5, 16, DenseLoRAConfig(block_m=32, block_k=16, split_k=1,
                                                   block_n=16)),
    (1, 40, (24, 8, 8), 2, 8, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}K{c[1]}S{len(c[2])}r{c[4]}")
@pytest.mark.parametrize("add_inputs", [True, False])
def test_dense_lora_matches_reference(case, add_inputs):
    m, k, ns, slots, rank, cfg = case
    y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=m * 31 + k)
    groups = group_tokens(lora, slots + 1)
    cfg = cfg or dense_config(m, k, len(ns))
    ref = dense_reference(y, x, a, b, lora.cpu(), 0.5, add_inputs)
    base = dense_reference(y, x, a, b, torch.full_like(lora.cpu(), -1), 0.5)
    part = dense_lora_shrink(x, a, groups, cfg, scale=0.5)
    dense_lora_expand(y, part, b, groups, cfg, add_inputs=add_inputs)
    tol = 5e-3 if HAS_CUDA else 2e-4
    assert rel_err(y, ref) < tol
    # rows without an adapter are untouched, and the LoRA part is not negligible
    untouched = lora.cpu() < 0
    assert torch.equal(y.cpu()[untouched].double(), ref.cpu()[untouched])
    assert rel_err(base, ref) > 1e-2


def fused_config(m: int, k: int, ns, cfg: DenseLoRAConfig | None) -> DenseLoRAConfig:
    """The case's tiles (or the heuristic's) with ``fused`` on."""
    from dataclasses import replace

    return replace(cfg or dense_config(m, k, len(ns)), fused=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}K{c[1]}S{len(c[2])}r{c[4]}")
@pytest.mark.parametrize("add_inputs", [True, False])
def test_fused_shrink_expand_matches_reference(case, add_inputs):
    """The one-launch form (``dense_lora_fused``): the same result as the pair, rows without an
    adapter untouched."""
    m, k, ns, slots, rank, cfg = case
    y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=m * 31 + k)
    groups = group_tokens(lora, slots + 1)
    ref = dense_reference(y, x, a, b, lora.cpu(), 0.5, add_inputs)
    dense_lora_fused(y, x, a, b, groups, fused_config(m, k, ns, cfg), scale=0.5,
                     add_inputs=add_inputs)
    assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4)
    untouched = lora.cpu() < 0
    assert torch.equal(y.cpu()[untouched].double(), ref.cpu()[untouched])


@pytest.mark.parametrize("m", [5, 40])
def test_fused_reads_nothing_past_slot_ranks_and_skips_dead_slots(m):
    """``slot_live`` in the fused form: NaN past a slot's rank is not read, a slot at 0 is
    skipped (its rows keep their values)."""
    k, ns, slots, rank = 40, (24, 8, 8), 4, 64
    ranks = [8, 64, 20, 0]
    y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=70 + m)
    lora[:4] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    groups = group_tokens(lora, slots + 1)
    a0, b0 = past_slot_ranks(a, ranks, 0.0, 2), past_slot_ranks(b, ranks, 0.0, 3)
    a_nan, b_nan = past_slot_ranks(a, ranks, float("nan"), 2), past_slot_ranks(
        b, ranks, float("nan"), 3)
    dead = lora.cpu() == 3
    ref = dense_reference(y, x, a0, b0, torch.where(dead, -1, lora.cpu()), 1.0)
    got = y.clone()
    dense_lora_fused(got, x, a_nan, b_nan, groups, fused_config(m, k, ns, None),
                     slot_live=torch.tensor(ranks, dtype=torch.int32, device=DEV))
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < (5e-3 if HAS_CUDA else 2e-4)
    assert torch.equal(got.cpu()[dead], y.cpu()[dead])


def test_layer_runs_the_fused_form_through_its_kept_launch():
    """``DenseLoRALayer`` with a fused config: the second call of the bucket (another step's
    tensors) launches the kept plan and still matches the reference."""
    from kernels.dense_lora import launch as tdl

    m, k, ns, slots, rank = 12, 40, (24, 8, 8), 3, 8
    _, _, a, b, _ = problem(m, k, ns, slots, rank, torch.float32, seed=21)
    layer = DenseLoRALayer(a, b)
    cfg = fused_config(m, k, ns, None)
    before = len(tdl._FUSED_PLANS.plans)
    for seed in (22, 23):
        y, x, _, _, lora = problem(m, k, ns, slots, rank, torch.float32, seed=seed)
        ref = dense_reference(y, x, a, b, lora.cpu(), 1.0)
        layer(y, x, group_tokens(lora, slots + 1), cfg)
        assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4), seed
    assert len(tdl._FUSED_PLANS.plans) - before == 1
    assert len(layer._calls.plans) == 1


def test_repeat_calls_through_prepared_launches_match_reference():
    """A second call of a known shape and M (fresh tensors and weights: another layer of the
    step) goes through the prepared launches; a misaligned input starts a new one."""
    from kernels.dense_lora import launch as tdl

    m, k, ns, slots, rank = 21, 40, (24, 8, 8), 3, 8
    cfg = dense_config(m, k, len(ns))
    before = (len(tdl._SHRINK_PLANS.plans), len(tdl._EXPAND_PLANS.plans))
    for seed in (1, 2, 3):
        y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=seed)
        if seed == 3:  # the same values from a 4-byte-offset copy: not 16-byte aligned
            x = torch.cat([x.new_zeros(m, 1), x], dim=1)[:, 1:]
        groups = group_tokens(lora, slots + 1)
        ref = dense_reference(y, x, a, b, lora.cpu(), 0.25, add_inputs=seed != 2)
        part = dense_lora_shrink(x, a, groups, cfg, scale=0.25)
        dense_lora_expand(y, part, b, groups, cfg, add_inputs=seed != 2)
        assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4), seed
    # shrink: one plan, then one for the misaligned x; expand: add and overwrite
    assert len(tdl._SHRINK_PLANS.plans) - before[0] == 2
    assert len(tdl._EXPAND_PLANS.plans) - before[1] == 2
    # the plans keep no tensor of a call (activations, buffers): those are the caller's
    for table in (tdl._SHRINK_PLANS, tdl._EXPAND_PLANS):
        assert not any(isinstance(v, torch.Tensor) for p in table.plans.values() for v in p.tail)


@pytest.mark.parametrize("m", [13, 70])
def test_slots_marked_not_live_are_skipped(m):
    """``slot_live``: tokens of a slot whose adapter has no weights for the layer are left as
    they are (no shrink, no expand), the others get their delta."""
    k, ns, slots, rank = 40, (24, 8), 3, 8
    y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=m)
    lora[1] = 1
    groups = group_tokens(lora, slots + 1)
    cfg = dense_config(m, k, len(ns))
    live = torch.tensor([rank, 0, rank], dtype=torch.int32, device=DEV)
    dead = lora.cpu() == 1
    ref = dense_reference(y, x, a, b, torch.where(dead, -1, lora.cpu()), 1.0)
    before = y.clone()
    part = dense_lora_shrink(x, a, groups, cfg, slot_live=live)
    dense_lora_expand(y, part, b, groups, cfg, slot_live=live)
    assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4)
    assert torch.equal(y.cpu()[dead], before.cpu()[dead])
    assert not torch.equal(y.cpu()[lora.cpu() == 0], before.cpu()[lora.cpu() == 0])


def past_slot_ranks(stacks, ranks, fill, rank_dim):
    """Copies of vLLM-style stacks ``[L, ..]``: every slot zero past its adapter's rank
    (``ranks [L]``) along ``rank_dim``, as vLLM holds them, and ``fill`` past that rank rounded
    up to 16 (what the kernels read of a slot: ``kernels.lora_tiles.rank_limit``)."""
    out = []
    for t in stacks:
        t = t.clone()
        for s, r in enumerate(ranks):
            read = min(-(-r // 16) * 16, t.shape[rank_dim])
            t[s].narrow(rank_dim - 1, r, t.shape[rank_dim] - r).zero_()
            t[s].narrow(rank_dim - 1, read, t.shape[rank_dim] - read).fill_(fill)
        out.append(t)
    return out


@pytest.mark.parametrize("m", [5, 40])
def test_slot_ranks_read_nothing_past_each_adapters_rank(m):
    """``slot_live`` holding each slot's adapter rank (vLLM zeroes a stack past it): the ops
    read A rows and B columns only up to it, so NaN there does not reach the output, and the
    result equals the zero-padded stacks' (what vLLM holds); without the ranks the NaN is read."""
    k, ns, slots, rank = 40, (24, 8, 8), 3, 64
    ranks = [8, 64, 20]
    y, x, a, b, lora = problem(m, k, ns, slots, rank, torch.float32, seed=40 + m)
    lora[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    groups = group_tokens(lora, slots + 1)
    cfg = dense_config(m, k, len(ns))
    a0, b0 = past_slot_ranks(a, ranks, 0.0, 2), past_slot_ranks(b, ranks, 0.0, 3)
    a_nan, b_nan = past_slot_ranks(a, ranks, float("nan"), 2), past_slot_ranks(
        b, ranks, float("nan"), 3)
    ref = dense_reference(y, x, a0, b0, lora.cpu(), 1.0)
    live = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    got = y.clone()
    dense_lora_expand(got, dense_lora_shrink(x, a_nan, groups, cfg, slot_live=live), b_nan,
                      groups, cfg, slot_live=live)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < (5e-3 if HAS_CUDA else 2e-4)
    unranked = y.clone()
    dense_lora_expand(unranked, dense_lora_shrink(x, a_nan, groups, cfg), b_nan, groups, cfg)
    assert torch.isnan(unranked[(lora == 0) | (lora == 2)]).all()


@pytest.mark.parametrize("with_mask", [False, True])
def test_groups_of_several_blocks_and_empty_groups(with_mask):
    """The compact row numbering: a group spanning several blocks (the last partial), a slot
    with no tokens, tokens without adapter between, a masked slot that gets no blocks."""
    m, k, ns, slots, rank = 75, 40, (24, 8), 4, 8
    y, x, a, b, _ = problem(m, k, ns, slots, rank, torch.float32, seed=12)
    lora = torch.tensor([0] * 37 + [-1] * 5 + [2] * 30 + [3] * 3, dtype=torch.int32)
    lora = lora[torch.randperm(m, generator=torch.Generator().manual_seed(3))].to(DEV)
    groups = group_tokens(lora, slots + 1)
    cfg = DenseLoRAConfig(block_m=16, block_k=16, split_k=2, block_n=16)
    live = (torch.tensor([rank, rank, 0, rank], dtype=torch.int32, device=DEV) if with_mask
            else None)
    effective = lora.cpu().clone()
    if with_mask:
        effective[effective == 2] = -1
    ref = dense_reference(y, x, a, b, effective, 1.0)
    part = dense_lora_shrink(x, a, groups, cfg, slot_live=live)
    dense_lora_expand(y, part, b, groups, cfg, slot_live=live)
    assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4)


def test_no_adapter_tokens_leave_output_untouched():
    y, x, a, b, lora = problem(9, 40, (24,), 2, 8, torch.float32, seed=5)
    lora[:] = -1
    before = y.clone()
    groups = group_tokens(lora, 3)
    cfg = dense_config(9, 40)
    dense_lora_expand(y, dense_lora_shrink(x, a, groups, cfg), b, groups, cfg)
    assert torch.equal(y, before)


# attention projections: (input width, output slices)
ATTENTION = {f"{s.name}-{op}": getattr(s, op) for s in MODELS.values() for op in ("qkv", "o")}


@pytest.mark.skipif(not HAS_CUDA, reason="real model shapes need a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 300, 1616])
@pytest.mark.parametrize("proj", sorted(ATTENTION))
def test_real_attention_shapes_bf16(m, proj):
    k, ns = ATTENTION[proj]
    y, x, a, b, lora = problem(m, k, ns, 8, 32, torch.bfloat16, seed=m)
    groups = group_tokens(lora, 9)
    cfg = dense_config(m, k, len(ns))
    ref = dense_reference(y, x, a, b, lora.cpu(), 1.0)
    fused = y.clone()
    part = dense_lora_shrink(x, a, groups, cfg, use_pdl=True)
    dense_lora_expand(y, part, b, groups, cfg, use_pdl=True)
    assert rel_err(y, ref) < 2e-2
    dense_lora_fused(fused, x, a, b, groups, fused_config(m, k, ns, cfg))
    assert rel_err(fused, ref) < 2e-2


def test_vllm_op_glue_matches_reference_and_honours_the_no_lora_flag():
    """``kernels.vllm.cuda.dense.dense_lora_linear`` (the op vLLM's ``add_lora_linear`` is routed
    to): vLLM's 4-D stacks, metadata as vLLM prepares it, the CPU "no adapter" flag."""
    from kernels.vllm.cuda import dense as vllm_cuda_dense

    y, x, a, b, lora = problem(23, 40, (24, 8, 8), 3, 8, torch.float32, seed=9)
    g = group_tokens(lora, 4)
    ref = dense_reference(y, x, a, b, lora.cpu(), 1.0)
    before = y.clone()
    vllm_cuda_dense.dense_lora_linear(y, x, a, b, 1.0, True, g.sorted_idx, g.slot, g.ntok,
                                      g.start, torch.tensor([True]))
    assert torch.equal(y, before)
    vllm_cuda_dense.dense_lora_linear(y, x, a, b, 1.0, True, g.sorted_idx, g.slot, g.ntok,
                                      g.start, torch.tensor([False]))
    assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4)
    assert rel_err(before, ref) > 1e-2


def test_vllm_op_skips_a_layer_no_adapter_of_the_step_targets(monkeypatch):
    from kernels.vllm.cuda import dense as vllm_cuda_dense
    from kernels.vllm.cuda import live as vllm_cuda_live

    y, x, a, b, lora = problem(11, 40, (24,), 3, 8, torch.float32, seed=4)
    g = group_tokens(lora, 4)
    monkeypatch.setattr(vllm_cuda_live, "_live", {a[0].data_ptr(): {2}})  # only slot 2 has it
    monkeypatch.setattr(vllm_cuda_live, "_step", {"slots": frozenset({0, 1})})
    before = y.clone()
    args = (1.0, True, g.sorted_idx, g.slot, g.ntok, g.start, torch.tensor([False]))
    vllm_cuda_dense.dense_lora_linear(y, x, a, b, *args)
    assert torch.equal(y, before)
    vllm_cuda_live._step["slots"] = frozenset({0, 2})
    vllm_cuda_dense.dense_lora_linear(y, x, a, b, *args)
    assert not torch.equal(y, before)


def test_vllm_op_inside_graphs_masks_slots_without_weights(monkeypatch):
    """When the step's slots are not known on the host (a CUDA-graph replay), the op hands the
    module's slot mask to the kernels: tokens of slots whose adapter has no weights here keep
    their rows; an overwriting call still writes every adapter row."""
    from kernels.vllm.cuda import dense as vllm_cuda_dense
    from kernels.vllm.cuda import live as vllm_cuda_live

    y, x, a, b, lora = problem(17, 40, (24, 8, 8), 3, 8, torch.float32, seed=6)
    lora[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    g = group_tokens(lora, 4)
    ranks = torch.tensor([8, 0, 8], dtype=torch.int32, device=DEV)
    monkeypatch.setattr(vllm_cuda_live, "_ranks", {a[0].data_ptr(): ranks})
    monkeypatch.setattr(vllm_cuda_live, "_tracking", [True])
    monkeypatch.setattr(vllm_cuda_live, "_step", {"slots": None})
    dead = lora.cpu() == 1
    tol = 5e-3 if HAS_CUDA else 2e-4
    for add_inputs in (True, False):
        y0 = y.clone()
        ref = dense_reference(y0, x, a, b, torch.where(dead, -1, lora.cpu()) if add_inputs
                              else lora.cpu(), 1.0, add_inputs)
        vllm_cuda_dense.dense_lora_linear(y0, x, a, b, 1.0, add_inputs, g.sorted_idx, g.slot,
                                          g.ntok, g.start, torch.tensor([False]))
        assert rel_err(y0, ref) < tol, add_inputs
        if add_inputs:
            assert torch.equal(y0.cpu()[dead], y.cpu()[dead])


def test_dense_layer_keeps_one_launch_pair_per_token_count():
    """``DenseLoRALayer``: a second step of the same size (new activations and token groups)
    launches the pair the layer kept; a misaligned input goes the long way and is not kept."""
    from kernels.dense_lora.layer import DenseLoRALayer

    m, k, ns, slots, rank = 19, 40, (24, 8, 8), 3, 8
    _, _, a, b, _ = problem(m, k, ns, slots, rank, torch.float32, seed=21)
    layer = DenseLoRALayer(a, b)
    cfg = dense_config(m, k, len(ns))
    for seed in (1, 2, 3):
        y, x, _, _, lora = problem(m, k, ns, slots, rank, torch.float32, seed=seed)
        if seed == 3:
            x = torch.cat([x.new_zeros(m, 1), x], dim=1)[:, 1:]
        ref = dense_reference(y, x, a, b, lora.cpu(), 0.5)
        layer(y, x, group_tokens(lora, slots + 1), cfg, scale=0.5)
        assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4), seed
        assert len(layer._calls.plans) == 1


def test_nearby_token_counts_share_one_launch_pair(monkeypatch):
    """Above ``PLAN_TOKENS_EXACT`` (made small here) token counts within one
    ``PLAN_TOKEN_GRAIN`` share the prepared pair (grid and partials sized for the bucket, the
    count given per launch): each step still matches the reference, rows past the count are
    left alone, and no new launch is prepared."""
    from kernels.dense_lora import launch as tdl
    from kernels.dense_lora.layer import DenseLoRALayer

    monkeypatch.setattr(tdl, "PLAN_TOKENS_EXACT", 8)
    monkeypatch.setattr(tdl, "PLAN_TOKEN_GRAIN", 32)
    assert [tdl.plan_tokens(m) for m in (8, 9, 19, 32, 33)] == [8, 32, 32, 32, 64]
    k, ns, slots, rank = 40, (24, 8, 8), 3, 8
    _, _, a, b, _ = problem(24, k, ns, slots, rank, torch.float32, seed=5)
    layer = DenseLoRALayer(a, b)
    for seed, m in enumerate((19, 23, 17, 32)):
        y, x, _, _, lora = problem(m, k, ns, slots, rank, torch.float32, seed=40 + seed)
        cfg = DenseLoRAConfig(block_m=16, block_k=16, split_k=2, block_n=16)
        ref = dense_reference(y, x, a, b, lora.cpu(), 0.5)
        plans = (len(tdl._SHRINK_PLANS.plans), len(tdl._EXPAND_PLANS.plans))
        layer(y, x, group_tokens(lora, slots + 1), cfg, scale=0.5)
        assert rel_err(y, ref) < (5e-3 if HAS_CUDA else 2e-4), m
        assert len(layer._calls.plans) == 1
        if seed:  # the first step's pair, launched again
            assert (len(tdl._SHRINK_PLANS.plans), len(tdl._EXPAND_PLANS.plans)) == plans
