"""Triton MoE-LoRA ops against kernels/reference.py.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, small odd shapes);
the GPT-OSS-20B / Qwen3-30B-A3B shape checks run only on a CUDA GPU.
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
    import triton  # noqa: F401  (the interpreter's standard library, before the kernels)

    from kernels.moe_lora.align import align_moe_lora, layout_blocks, max_num_blocks
    from kernels.moe_lora.configs import OpConfig
    from kernels.moe_lora.ops import MoELoRAOps
    from kernels.moe_math import MoELoRAWeights
    from kernels.reference import moe_lora_reference, random_moe_lora_problem
    from tests.helpers.moe_layer import moe_lora_layer

DEV = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("interpreter_when_no_gpu")
_ = interpreter_when_no_gpu  # the fixture, used through pytestmark


def forced_config(block_m: int, split_k: int, block_k: int, block_n: int,
                  naive: bool = False, parallel: bool = False, fused: bool = False) -> dict:
    shrink = OpConfig(block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
    expand = OpConfig(block_n=block_n, num_warps=4, num_stages=2)
    return {"block_m": block_m, "pdl": False, "naive": naive, "align_parallel": parallel,
            "fused": fused,
            "shrink13": shrink, "expand13": expand, "shrink2": shrink, "expand2": expand}


# float32 inputs: exact-ish in the interpreter, tf32 tensor-core dots on a GPU
TOL_F32 = 5e-3 if HAS_CUDA else 2e-4


CASES = [
    # T, H, I, E, K, L, r, activation, config
    (9, 40, 24, 5, 2, 3, 8, "silu", None),
    (13, 72, 48, 6, 3, 2, 24, "swigluoai", forced_config(16, 3, 16, 32)),
    (21, 56, 40, 4, 2, 3, 64, "silu", forced_config(32, 2, 32, 16)),
    (1, 48, 32, 7, 2, 2, 16, "swigluoai", forced_config(16, 5, 16, 16)),
    (5, 40, 24, 5, 3, 3, 8, "silu", forced_config(16, 2, 16, 16, naive=True)),
    (4, 40, 24, 5, 3, 3, 8, "swigluoai", forced_config(16, 2, 16, 16, naive=True, fused=True)),
    (300, 40, 24, 5, 4, 3, 8, "silu", forced_config(16, 2, 16, 16, parallel=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}r{c[6]}")
def test_layer_matches_reference(case, seed):
    t, h, i, e, k, n_slots, r, act, cfg = case
    p = random_moe_lora_problem(t, h, i, e, k, n_slots, r, dtype=torch.float32, device=DEV,
                                no_adapter_fraction=0.3, slots_without_experts=(1,),
                                with_bias=True, seed=seed)
    p["token_lora"][0] = 0  # at least one token with expert LoRA
    got = moe_lora_layer(**p, activation=act, config=cfg)
    ref = moe_lora_reference(**p, activation=act, compute_dtype=torch.float64)
    base = moe_lora_reference(**{**p, "lora": None}, activation=act,
                              compute_dtype=torch.float64)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL_F32
    # the LoRA part is not negligible, so a kernel that skipped it would fail
    assert rel_err(base, ref) > 1e-2


@pytest.mark.parametrize("case", [CASES[1], CASES[-1]], ids=["single-align", "parallel-align"])
def test_repeat_layers_through_prepared_launches_match_reference(case):
    """Layer after layer of one shape and M (fresh weights, routing and inputs each time, as in
    a step) reuses the prepared launches of the first: no new plan, results still right."""
    from kernels.moe_lora import align as moe_lora_align
    from kernels.moe_lora import launch as triton_moe_lora

    t, h, i, e, k, n_slots, r, act, cfg = case
    tables = (triton_moe_lora._SHRINK_PLANS, triton_moe_lora._EXPAND_PLANS,
              moe_lora_align._ALIGN_PLANS)
    for seed in range(3):
        p = random_moe_lora_problem(t, h, i, e, k, n_slots, r, dtype=torch.float32, device=DEV,
                                    no_adapter_fraction=0.3, slots_without_experts=(1,),
                                    generator=torch.Generator().manual_seed(1000 + seed))
        p["token_lora"][0] = 0
        got = moe_lora_layer(**p, activation=act, config=cfg)
        ref = moe_lora_reference(**p, activation=act, compute_dtype=torch.float64)
        assert rel_err(got, ref) < TOL_F32, seed
        counts = [len(tb.plans) for tb in tables]
        if seed:
            assert counts == first, "a repeat layer built new launches"
        first = counts
    # the plans keep no tensor of a call (activations, buffers, block tables)
    launches = [p for tb in tables[:2] for p in tb.plans.values()]
    launches += [p for plans in tables[2].plans.values() for p in plans]
    assert launches and not any(isinstance(v, torch.Tensor) for p in launches for v in p.tail)


@pytest.mark.parametrize("cfg", [forced_config(16, 2, 16, 16), forced_config(16, 3, 16, 32),
                                 forced_config(16, 2, 16, 16, naive=True),
                                 forced_config(16, 2, 16, 16, naive=True, fused=True)],
                         ids=["sorted", "sorted-split3", "naive", "fused"])
def test_slot_ranks_read_nothing_past_each_adapters_rank(cfg):
    """Each slot's adapter rank in ``enabled`` (``slot_ranks``; vLLM zeroes a stack past it):
    every kernel path reads A rows and B columns only up to it, so NaN there never reaches the
    output, which equals the zero-padded stacks' reference; without the ranks it is read."""
    import dataclasses

    t, h, i, e, k, n_slots, r = 9, 40, 24, 5, 2, 3, 64
    ranks = torch.tensor([8, 64, 20])
    p = random_moe_lora_problem(t, h, i, e, k, n_slots, r, dtype=torch.float32, device=DEV,
                                no_adapter_fraction=0.2, seed=17)
    p["token_lora"][:3] = torch.tensor([0, 1, 2])

    def past_ranks(fill):
        """Zero past each slot's rank (as vLLM holds it), ``fill`` past that rank rounded up to
        16 (what the kernels read: ``kernels.lora_tiles.rank_limit``)."""
        lora = p["lora"]
        out = {}
        for name, dim in (("w13_a", 2), ("w13_b", 3), ("w2_a", 2), ("w2_b", 3)):
            w = getattr(lora, name).clone()
            for s, rs in enumerate(ranks.tolist()):
                read = min(-(-rs // 16) * 16, r)
                w[s].narrow(dim - 1, rs, r - rs).zero_()
                w[s].narrow(dim - 1, read, r - read).fill_(fill)
            out[name] = w
        return dataclasses.replace(lora, **out)

    ref = moe_lora_reference(**{**p, "lora": past_ranks(0.0)}, activation="silu",
                             compute_dtype=torch.float64)
    poisoned = {**p, "lora": past_ranks(float("nan"))}
    got = moe_lora_layer(**poisoned, activation="silu", config=cfg, slot_ranks=ranks)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL_F32
    unranked = moe_lora_layer(**poisoned, activation="silu", config=cfg)
    assert torch.isnan(unranked[p["token_lora"] == 0]).all()


def test_align_puts_every_lora_row_in_one_block(seed):
    gen = torch.Generator().manual_seed(seed + 1)
    m, k, e, n_slots, bm = 37, 3, 6, 4, 16
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    ids[3, 1] = -1  # an expert that is not local
    lora = torch.randint(-1, n_slots, (m,), generator=gen, dtype=torch.int32)
    enabled = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    blocks = align_moe_lora(ids.to(DEV), lora.to(DEV), enabled.to(DEV), e, bm)
    nb = int(blocks.num_blocks[0])
    assert 0 < nb <= max_num_blocks(m * k, n_slots * e, bm) <= blocks.max_blocks
    assert blocks.max_blocks == layout_blocks(m * k, n_slots * e, bm)
    assert blocks.max_blocks % 64 == 0  # whole grains: nearby batch sizes share the layout
    pair = blocks.block_pair[:nb].cpu().tolist()
    nrows = blocks.block_nrows[:nb].cpu().tolist()
    rows = blocks.sorted_rows.cpu()
    seen = []
    for b in range(nb):
        assert 1 <= nrows[b] <= bm
        for row in rows[b * bm : b * bm + nrows[b]].tolist():
            tok, kk = divmod(row, k)
            assert int(lora[tok]) * e + int(ids[tok, kk]) == pair[b]
            seen.append(row)
    want = [t * k + kk for t in range(m) for kk in range(k)
            if lora[t] >= 0 and enabled[lora[t]] and ids[t, kk] >= 0]
    assert sorted(seen) == sorted(want)


def test_batch_without_lora_leaves_outputs_alone(seed):
    m, h, i, e, k, n_slots, r = 6, 32, 24, 4, 2, 2, 8
    p = random_moe_lora_problem(m, h, i, e, k, n_slots, r, device=DEV, no_adapter_fraction=1.0, seed=seed)
    lora = p["lora"]
    for naive in (False, True):
        ops = MoELoRAOps(p["topk_ids"], p["token_lora"], lora.has_experts.to(torch.int32), e, h,
                         i, r, n_slots, config=forced_config(16, 2, 16, 16, naive=naive))
        if not naive:
            assert int(ops.blocks.num_blocks[0]) == 0
        y13 = torch.randn(m * k, 2 * i, device=DEV)
        before = y13.clone()
        ops.add_w13(y13, p["x"], lora.w13_a, lora.w13_b, scaling=lora.scaling)
        assert torch.equal(y13, before)


def test_two_slice_gate_up_matches_folded_reference(seed):
    """vLLM's per-expert stacks: separate gate/up A and B, written to [gate | up] columns."""
    m, h, i, e, k, n_slots, r = 11, 40, 24, 5, 2, 3, 16
    p = random_moe_lora_problem(m, h, i, e, k, n_slots, r, device=DEV, no_adapter_fraction=0.2, seed=seed)

    def rnd(*s, std):
        return torch.randn(*s, device=DEV) * std

    ga, ua = rnd(n_slots, e, r, h, std=h**-0.5), rnd(n_slots, e, r, h, std=h**-0.5)
    gb, ub = rnd(n_slots, e, i, r, std=r**-0.5), rnd(n_slots, e, i, r, std=r**-0.5)
    w13_a, w13_b = MoELoRAWeights.from_gate_up(ga, gb, ua, ub)
    scaling = torch.full((n_slots,), 0.5, device=DEV)
    enabled = torch.ones(n_slots, dtype=torch.int32, device=DEV)
    ops = MoELoRAOps(p["topk_ids"], p["token_lora"], enabled, e, h, i, r, n_slots,
                     config=forced_config(16, 2, 16, 16))
    y13 = torch.randn(m * k, 2 * i, device=DEV)
    want = y13.double().clone()
    ops.add_w13(y13, p["x"], (ga, ua), (gb, ub), scaling=scaling)
    for row in range(m * k):
        tok, kk = divmod(row, k)
        a = int(p["token_lora"][tok])
        if a < 0:
            continue
        ex = int(p["topk_ids"][tok, kk])
        xt = p["x"][tok].double()
        want[row] += 0.5 * (xt @ w13_a[a, ex].double().t()) @ w13_b[a, ex].double().t()
    assert rel_err(y13, want) < TOL_F32


def test_padded_base_caches_get_the_delta_in_their_leading_columns(seed):
    """A base backend that pads (Marlin MXFP4: hidden and intermediate rounded up) hands wider
    activations and caches: the ops read the first ``in`` columns of x / h, add into the first
    ``S*N`` columns of y, and leave the padding columns exactly as they were."""
    m, h, i, e, k, n_slots, r, pad = 9, 40, 24, 5, 2, 3, 16, 24
    p = random_moe_lora_problem(m, h, i, e, k, n_slots, r, device=DEV, no_adapter_fraction=0.2, seed=seed)
    lora = p["lora"]
    cfg = forced_config(16, 2, 16, 16)
    enabled = lora.has_experts.to(torch.int32)

    def ops():
        return MoELoRAOps(p["topk_ids"], p["token_lora"], enabled, e, h, i, r, n_slots, config=cfg)

    x_wide = torch.cat([p["x"], torch.randn(m, pad, device=DEV) * 1e3], dim=1)
    hid = torch.randn(m * k, i, device=DEV)
    h_wide = torch.cat([hid, torch.randn(m * k, pad, device=DEV) * 1e3], dim=1)
    y13, y2 = torch.randn(m * k, 2 * i, device=DEV), torch.randn(m * k, h, device=DEV)
    y13_wide = torch.cat([y13, torch.randn(m * k, pad, device=DEV)], dim=1)
    y2_wide = torch.cat([y2, torch.randn(m * k, pad, device=DEV)], dim=1)
    pad13, pad2 = y13_wide[:, 2 * i:].clone(), y2_wide[:, h:].clone()
    tw = torch.rand(m, k, device=DEV)

    narrow = ops()
    narrow.add_w13(y13, p["x"], lora.w13_a, lora.w13_b, scaling=lora.scaling)
    narrow.add_w2(y2, hid, lora.w2_a, lora.w2_b, tw, scaling=lora.scaling)
    wide = ops()
    wide.add_w13(y13_wide, x_wide, lora.w13_a, lora.w13_b, scaling=lora.scaling)
    wide.add_w2(y2_wide, h_wide, lora.w2_a, lora.w2_b, tw, scaling=lora.scaling)
    assert rel_err(y13_wide[:, : 2 * i], y13) < TOL_F32
    assert rel_err(y2_wide[:, :h], y2) < TOL_F32
    assert torch.equal(y13_wide[:, 2 * i:], pad13) and torch.equal(y2_wide[:, h:], pad2)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [
    pytest.param((*s.experts, s.activation), id=s.name) for s in MODELS.values()
])
@pytest.mark.parametrize("num_tokens", [1, 16, 200])
def test_gpu_model_shapes_bf16(shape, num_tokens, seed):
    h, i, e, k, act = shape
    p = random_moe_lora_problem(num_tokens, h, i, e, k, 8, 32, dtype=torch.bfloat16,
                                device="cuda", with_bias=act == "swigluoai", seed=seed)
    got = moe_lora_layer(**p, activation=act)
    # full oracle in float64 on the GPU, on the same bf16 inputs
    lora = p["lora"]
    lora64 = MoELoRAWeights(lora.w13_a.double(), lora.w13_b.double(), lora.w2_a.double(),
                            lora.w2_b.double(), lora.scaling.double(), lora.has_experts)
    ref = moe_lora_reference(**{**p, "lora": lora64}, activation=act,
                             compute_dtype=torch.float64)
    assert torch.isfinite(got.float()).all()
    assert rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("slot_ranks", [False, True])
@pytest.mark.parametrize("mxfp4", [False, True])
def test_warm_up_launches_every_variant_serving_launches(mxfp4, slot_ranks, seed, monkeypatch):
    """Every kernel variant a served batch of each config's M launches (real routing, adapters,
    tokens without one) was launched by the warm-up, so none compiles while serving; the
    warm-up only reads the weights."""
    from kernels.moe_lora.activation import swiglu_rows_without_lora
    from kernels.moe_lora.align import align_chunk
    from kernels.moe_lora.ops import warm_up
    from tests.helpers.launch_spy import LaunchSpy

    assert [align_chunk(n) for n in (1, 256, 257, 1024, 1025, 10**6)] == [
        256, 256, 1024, 1024, 4096, 4096]
    e, k, n_slots = 5, 2, 3
    p = random_moe_lora_problem(3, 40, 24, e, k, n_slots, 8, device=DEV, seed=seed)
    lora = p["lora"]
    weights = (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)
    before = [w.clone() for w in weights]
    configs = [(1, forced_config(16, 2, 16, 16, naive=True)), (6, forced_config(32, 1, 32, 32)),
               (9, forced_config(16, 1, 32, 32, parallel=True))]
    spy = LaunchSpy(monkeypatch)
    with spy.phase("warm-up") as warmed:
        warm_up(*weights, e, k, configs, mxfp4=mxfp4, slot_ranks=slot_ranks)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))
    with spy.phase("serving") as served:
        for m, cfg in configs:
            q = random_moe_lora_problem(m, 40, 24, e, k, n_slots, 8, device=DEV, seed=seed + m)
            enabled = q["lora"].has_experts.to(torch.int32) * (4 if slot_ranks else 1)
            ops = MoELoRAOps(q["topk_ids"], q["token_lora"], enabled, e, 40, 24, 8, n_slots,
                             config=cfg, slot_ranks=slot_ranks)
            rows = m * k
            y13 = torch.zeros(rows, 48, device=DEV)
            rmap = torch.randperm(rows).to(torch.int32).to(DEV) if mxfp4 else None
            ops.add_w13(y13, q["x"], lora.w13_a, lora.w13_b, row_map=rmap)
            if mxfp4:
                act = torch.empty(rows, 24, device=DEV)
                ops.add_w13(y13, q["x"], lora.w13_a, lora.w13_b, act=act, row_map=rmap)
                swiglu_rows_without_lora(act, y13, q["topk_ids"], q["token_lora"], enabled, e,
                                         row_map=rmap)
            ops.add_w2(torch.zeros(rows, 40, device=DEV), torch.randn(rows, 24, device=DEV),
                       lora.w2_a, lora.w2_b, q["topk_weights"], row_map=rmap)
    assert served, "the served batches launched nothing: the spy sees no launch"
    assert served <= warmed, f"served variants the warm-up never launched: {served - warmed}"


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("num_tokens", [5, 6, 7, 37, 38, 401])
def test_block_tables_start_on_16_byte_boundaries(num_tokens, parallel):
    """Triton specialises pointers on 16-byte alignment: the block tables must be aligned for
    every batch size, or each new M compiles a new kernel variant while serving."""
    ids = torch.zeros(num_tokens, 3, dtype=torch.int32, device=DEV)
    blocks = align_moe_lora(ids, torch.zeros(num_tokens, dtype=torch.int32, device=DEV),
                            torch.ones(4, dtype=torch.int32, device=DEV), 6, 16, parallel=parallel)
    for t in (blocks.sorted_rows, blocks.block_pair, blocks.block_nrows, blocks.num_blocks):
        assert t.data_ptr() % 16 == 0
    assert blocks.block_pair.numel() == blocks.block_nrows.numel() == blocks.max_blocks
    assert blocks.sorted_rows.numel() == blocks.max_blocks * 16


@pytest.mark.parametrize("num_tokens,top_k,bm", [(1, 2, 16), (300, 3, 16), (700, 4, 32),
                                                 (517, 8, 64)])
def test_parallel_align_builds_the_same_blocks(num_tokens, top_k, bm, seed):
    """The two-launch align (several chunks when rows > PARALLEL_CHUNK) gives the single
    program's blocks: same count, same pair and row count per block, same rows per pair (which
    of a pair's blocks a row lands in follows the order of the atomics, on a GPU not fixed)."""
    gen = torch.Generator().manual_seed(seed + 1)
    e, n_slots = 9, 5
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[::7, 0] = -1  # experts that are not local
    lora = torch.randint(-1, n_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    enabled = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    args = (ids.to(torch.int32).to(DEV), lora.to(DEV), enabled.to(DEV), e, bm)
    one, par = align_moe_lora(*args), align_moe_lora(*args, parallel=True)
    nb = int(one.num_blocks[0])
    assert nb == int(par.num_blocks[0]) and par.max_blocks == one.max_blocks
    assert torch.equal(one.block_pair[:nb].cpu(), par.block_pair[:nb].cpu())
    assert torch.equal(one.block_nrows[:nb].cpu(), par.block_nrows[:nb].cpu())

    def rows_per_pair(blocks) -> dict[int, list[int]]:
        rows = blocks.sorted_rows.cpu().tolist()
        out: dict[int, list[int]] = {}
        for b, (pair, n) in enumerate(zip(blocks.block_pair[:nb].cpu().tolist(),
                                          blocks.block_nrows[:nb].cpu().tolist())):
            out.setdefault(pair, []).extend(rows[b * bm : b * bm + n])
        return {pair: sorted(r) for pair, r in out.items()}

    want = rows_per_pair(one)
    assert sum(len(r) for r in want.values()) == int(one.block_nrows[:nb].sum())
    assert rows_per_pair(par) == want


FUSED_CASES = [
    # T, H, I, E, K, L, r, slices (gate_up), add_inputs
    (3, 40, 24, 5, 2, 3, 8, 1, True),
    (5, 72, 48, 6, 3, 2, 24, 2, False),
    (1, 56, 40, 4, 2, 3, 64, 1, True),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"T{c[0]}H{c[1]}S{c[7]}r{c[6]}")
def test_fused_single_launch_equals_the_op_pair(case):
    """The one-launch path for tiny batches gives what shrink + expand give (naive layout),
    for gate_up (1 or 2 slices, scale) and down (routing weights), adding or overwriting."""
    from kernels.moe_lora.fused import moe_lora_fused
    from kernels.moe_lora.launch import moe_lora_expand, moe_lora_shrink

    t, h, i, e, k, n_slots, r, slices, add = case
    g = torch.Generator().manual_seed(t * 7 + h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    lora = torch.randint(-1, n_slots, (t,), generator=g, dtype=torch.int32)
    lora[0] = 0
    enabled = torch.ones(n_slots, dtype=torch.int32)
    enabled[n_slots - 1] = 0
    ids, lora, enabled = ids.to(DEV), lora.to(DEV), enabled.to(DEV)
    blocks = align_moe_lora(ids, lora, enabled, e, 16, naive=True)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    a13 = [rnd(n_slots, e, r, h) / h**0.5 for _ in range(slices)]
    b13 = [rnd(n_slots, e, i * 2 // slices, r) for _ in range(slices)]
    a2, b2 = rnd(n_slots, e, r, i) / i**0.5, rnd(n_slots, e, h, r)
    x, hh = rnd(t, h), rnd(t * k, i)
    scale = torch.rand(n_slots, generator=g).to(DEV) + 0.5
    tw = torch.rand(t, k, generator=g).to(DEV)
    cfg = OpConfig(block_k=16, split_k=2, block_n=16, num_warps=4, num_stages=2)
    for xin, a, b, div, n_out, w, sc in ((x, a13, b13, k, 2 * i, None, scale),
                                         (hh, [a2], [b2], 1, h, tw, None)):
        y0 = rnd(t * k, n_out)
        want, got = y0.clone(), y0.clone()
        part = moe_lora_shrink(xin, a, blocks, div, cfg)
        moe_lora_expand(want, part, b, blocks, cfg, scaling=sc, topk_weights=w, add_inputs=add)
        moe_lora_fused(got, xin, a, b, blocks, div, scaling=sc, topk_weights=w, add_inputs=add,
                       block_k=16, block_n=16)
        assert rel_err(got, want) < TOL_F32
        assert rel_err(y0, want) > 1e-2


@pytest.mark.parametrize("parallel", [False, True])
def test_moe_layer_repeat_steps_launch_what_the_first_kept(parallel, monkeypatch):
    """``MoELoRALayer`` (what the vLLM glue calls per layer): steps after the first — of the
    same token count or a nearby one (same layout grain) — launch the kept align and op pairs
    and give what ``MoELoRAOps`` gives on the same inputs; a misaligned activation takes the
    long way and keeps nothing new."""
    from kernels.moe_lora import ops as triton_moe_lora_ops
    from kernels.moe_lora.layer import MoELoRALayer

    t, h, i, e, k, n_slots, r = 70, 40, 24, 5, 4, 3, 8
    cfg = forced_config(16, 2, 16, 16, parallel=parallel)
    monkeypatch.setattr(triton_moe_lora_ops, "get_layer_config", lambda *a, **kw: cfg)
    p0 = random_moe_lora_problem(t, h, i, e, k, n_slots, r, device=DEV,
                                 generator=torch.Generator().manual_seed(7))
    w = p0["lora"]
    layer = MoELoRALayer(w.w13_a, w.w13_b, w.w2_a, w.w2_b, num_experts=e, num_slots=n_slots)
    enabled = w.has_experts.to(torch.int32)
    for seed, t in enumerate((70, 70, 67, 70, 73)):  # 268..292 rows: one layout grain
        p = random_moe_lora_problem(t, h, i, e, k, n_slots, r, device=DEV,
                                    generator=torch.Generator().manual_seed(100 + seed))
        x = p["x"]
        if seed == 3:  # 4 bytes off a 16-byte boundary: the long way
            x = torch.cat([x.new_zeros(t, 1), x], dim=1)[:, 1:]
        hid = torch.randn(t * k, i, device=DEV)
        y13, y2 = torch.randn(t * k, 2 * i, device=DEV), torch.randn(t * k, h, device=DEV)
        before, want13, want2 = y13.clone(), y13.clone(), y2.clone()
        ops = MoELoRAOps(p["topk_ids"], p["token_lora"], enabled, e, h, i, r, n_slots)
        ops.add_w13(want13, x, w.w13_a, w.w13_b)
        ops.add_w2(want2, hid, w.w2_a, w.w2_b, p["topk_weights"])
        step = layer.gate_up(y13, x, p["topk_ids"], p["token_lora"], enabled)
        step.down(y2, hid, p["topk_weights"])
        assert rel_err(y13, want13.double()) < 1e-5 and rel_err(y2, want2.double()) < 1e-5
        assert not torch.equal(y13, before) and step.fast == (seed != 3)
        assert (len(layer._up.plans), len(layer._down.plans)) == (1, 1)
