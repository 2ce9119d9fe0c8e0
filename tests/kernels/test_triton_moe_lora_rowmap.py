"""MoE-LoRA ops with a row map: the ``[M*K, ·]`` activations in a base backend's row order.

Row ``t*K+k``'s activation row is ``row_map[t*K+k]`` (the MXFP4 experts' expert-sorted rows).
Against the same ops without a map (themselves checked against ``kernels/reference.py`` in
``tests/kernels/test_triton_moe_lora.py``): every layout (naive, fused tiny-batch, sorted, parallel
sort), gate_up with one or two slices, the activation folded into the gate_up expand and its
complement, first calls and the layer's kept launches. The mapped outputs hold the unmapped ones
at the mapped rows, bit for bit, and rows nothing maps to stay untouched. Interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_interpret import (
    HAS_CUDA,
    interpreter_unless_cuda,
    interpreter_when_no_gpu,
)

with interpreter_unless_cuda():
    from kernels.moe_lora.activation import swiglu_rows_without_lora
    from kernels.moe_lora.layer import MoELoRALayer
    from kernels.moe_lora.ops import MoELoRAOps
    from tests.kernels.test_triton_moe_lora import DEV, forced_config

pytestmark = pytest.mark.usefixtures("interpreter_when_no_gpu")
_ = interpreter_when_no_gpu  # the fixture, used through pytestmark

CONFIGS = {
    "naive": forced_config(16, 2, 16, 16, naive=True),
    "fused": forced_config(16, 2, 16, 16, naive=True, fused=True),
    "sorted": forced_config(16, 3, 16, 32),
    "sorted-bm32": forced_config(32, 1, 32, 16),
    "parallel": forced_config(16, 2, 16, 16, parallel=True),
}


def problem(tokens: int, slices: int, seed: int, hidden=40, inter=24, experts=5, top_k=3,
            slots=3, rank=8):
    """Routing (one padding pair), slots (one token without adapter, slot 1 without expert
    LoRA), weights, inputs, and a row map into one spare row more than the pairs."""
    g = torch.Generator().manual_seed(seed)
    rows = tokens * top_k
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    ids[-1, -1] = -1  # a padding pair: no row of its own
    lora = torch.randint(0, slots, (tokens,), generator=g, dtype=torch.int32)
    lora[0], lora[-1] = 0, -1
    enabled = torch.tensor([1, 0] + [1] * (slots - 2), dtype=torch.int32)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(DEV)

    row_map = torch.randperm(rows + 1, generator=g)[:rows].to(torch.int32)
    row_map[-1] = -1  # the padding pair's
    return dict(
        ids=ids.to(DEV), lora=lora.to(DEV), enabled=enabled.to(DEV), row_map=row_map.to(DEV),
        a13=[rnd(slots, experts, rank, hidden, std=hidden**-0.5) for _ in range(slices)],
        b13=[rnd(slots, experts, 2 * inter // slices, rank) for _ in range(slices)],
        a2=rnd(slots, experts, rank, inter, std=inter**-0.5), b2=rnd(slots, experts, hidden, rank),
        x=rnd(tokens, hidden), y13=rnd(rows + 1, 2 * inter), h=rnd(rows + 1, inter),
        y2=rnd(rows, hidden), tw=torch.rand(tokens, top_k, generator=g).to(DEV),
        dims=(experts, hidden, inter, rank, slots))


def mapped(t: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """``t`` in pair order → the same rows at ``row_map`` (spare rows and the padding pair's
    row keep ``t``'s last row, which nothing maps to)."""
    out = t.clone()
    ok = row_map >= 0
    out[row_map[ok].long()] = t[: row_map.numel()][ok]
    return out


def pair_rows(t: torch.Tensor, row_map: torch.Tensor, is_mapped: bool) -> torch.Tensor:
    """The rows of the real pairs (all but the padding pair, the last), in pair order, of ``t``
    in pair order or (``is_mapped``) at the map's rows."""
    real = row_map.numel() - 1
    return t[row_map[:real].long()] if is_mapped else t[:real]


def unmapped_rows(t: torch.Tensor, row_map: torch.Tensor) -> list[int]:
    """Rows of a mapped ``t`` that no real pair maps to."""
    return sorted(set(range(t.shape[0])) - set(row_map.tolist()))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("tokens", [4, 13])
def test_ops_through_a_row_map_equal_the_ops_in_pair_order(config, slices, tokens):
    p = problem(tokens, slices, seed=tokens * 10 + slices)
    experts, hidden, inter, rank, slots = p["dims"]
    rmap = p["row_map"]

    def ops():
        return MoELoRAOps(p["ids"], p["lora"], p["enabled"], experts, hidden, inter, rank, slots,
                          config=CONFIGS[config])

    # gate_up: pair order vs the same rows moved by the map (one spare row: untouched)
    y13_pair, y13_map = p["y13"].clone(), mapped(p["y13"], rmap)
    ops().add_w13(y13_pair, p["x"], p["a13"], p["b13"])
    ops().add_w13(y13_map, p["x"], p["a13"], p["b13"], row_map=rmap)
    assert not torch.equal(y13_pair, p["y13"])  # the delta is there
    assert torch.equal(pair_rows(y13_map, rmap, True), pair_rows(y13_pair, rmap, False))
    spare = unmapped_rows(y13_map, rmap)
    assert len(spare) == 2 and torch.equal(y13_map[spare], mapped(p["y13"], rmap)[spare])
    # down: input rows through the map, output in pair order
    y2_pair, y2_map = p["y2"].clone(), p["y2"].clone()
    ops().add_w2(y2_pair, p["h"], p["a2"], p["b2"], p["tw"])
    ops().add_w2(y2_map, mapped(p["h"], rmap), p["a2"], p["b2"], p["tw"], row_map=rmap)
    assert not torch.equal(y2_pair, p["y2"])
    assert torch.equal(y2_map, y2_pair)


@pytest.mark.parametrize("config", ["naive", "sorted", "parallel"])
@pytest.mark.parametrize("tokens", [4, 13])
def test_folded_activation_and_complement_through_a_row_map(config, tokens):
    """The gate_up expand writing the activation (``act``) and the complement kernel doing the
    rows without expert LoRA, both through the map: the pair-order result at the mapped rows;
    nothing at the spare row or for the padding pair."""
    p = problem(tokens, 1, seed=tokens)
    experts, hidden, inter, rank, slots = p["dims"]
    rmap, ids, lora, enabled = p["row_map"], p["ids"], p["lora"], p["enabled"]
    acts = []
    for row_map in (None, rmap):
        y13 = p["y13"].clone() if row_map is None else mapped(p["y13"], rmap)
        act = torch.full((y13.shape[0], inter), float("nan"), device=DEV)
        done = MoELoRAOps(ids, lora, enabled, experts, hidden, inter, rank, slots,
                          config=CONFIGS[config]).add_w13(y13, p["x"], p["a13"], p["b13"],
                                                          act=act, row_map=row_map)
        assert done
        swiglu_rows_without_lora(act, y13, ids, lora, enabled, experts, row_map=row_map)
        acts.append(act)
    want = pair_rows(acts[0], rmap, False)
    assert not want.isnan().any()  # every real pair's row written
    assert torch.equal(pair_rows(acts[1], rmap, True), want)
    spare = unmapped_rows(acts[1], rmap)  # includes the row the padding pair would have had
    assert len(spare) == 2 and acts[1][spare].isnan().all()


def test_complement_kept_launch_serves_nearby_token_counts(monkeypatch):
    """The complement alone against torch for 13, 12 and 13 tokens again (one grid bucket: the
    first call prepares the launch, the others reuse it with their own tensors and row count):
    GPT-OSS's activation at the mapped row of every pair without expert LoRA (no adapter, a
    slot without expert LoRA), nothing anywhere else."""
    from kernels.launch.cached import LaunchPlans
    from kernels.moe_lora import activation as act_mod

    monkeypatch.setattr(act_mod, "_COMPLEMENT_PLANS", LaunchPlans(act_mod._COMPLEMENT, 256))
    prepared = []
    real_prepare = act_mod._COMPLEMENT.prepare
    monkeypatch.setattr(act_mod._COMPLEMENT, "prepare",
                        lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
    for tokens in (13, 12, 13):
        p = problem(tokens, 1, seed=tokens)
        experts, _, inter, _, _ = p["dims"]
        ids, lora, enabled, rmap = p["ids"], p["lora"], p["enabled"], p["row_map"]
        y13 = p["y13"]
        act = torch.full((y13.shape[0], inter), float("nan"), device=DEV)
        swiglu_rows_without_lora(act, y13, ids, lora, enabled, experts, row_map=rmap)
        want = torch.full_like(act, float("nan"))
        k = ids.shape[1]
        for pair in range(ids.numel()):
            slot, row = int(lora[pair // k]), int(rmap[pair])
            if row < 0 or (slot >= 0 and int(enabled[slot])):
                continue  # padding pair, or a row the expand writes
            gate = y13[row, 0::2].float().clamp(max=7.0)
            up = y13[row, 1::2].float().clamp(-7.0, 7.0)
            want[row] = gate * torch.sigmoid(1.702 * gate) * (up + 1)
        assert not want.isnan().all()
        assert torch.allclose(act, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert len(prepared) == 1 and len(act_mod._COMPLEMENT_PLANS.plans) == 1  # kept for all


@pytest.mark.parametrize("config", ["sorted", "parallel"])
def test_layer_kept_launches_carry_the_row_map(config, monkeypatch):
    """``MoELoRALayer``: the first step of a size goes through ``MoELoRAOps``, repeat steps
    through the kept launches; with a row map both equal the pair-order layer, and the step
    hands its map to ``down``."""
    tokens = 13
    p = problem(tokens, 1, seed=3)
    experts, hidden, inter, rank, slots = p["dims"]
    rmap = p["row_map"]
    layers = {}
    import kernels.moe_lora.ops as ops_module

    monkeypatch.setattr(ops_module, "get_layer_config", lambda m, **kw: CONFIGS[config])
    for name in ("pair", "map"):
        layer = MoELoRALayer(p["a13"], p["b13"], p["a2"], p["b2"], experts, slots)
        outs = []
        for _ in range(2):
            row_map = rmap if name == "map" else None
            y13 = p["y13"].clone() if row_map is None else mapped(p["y13"], rmap)
            step = layer.gate_up(y13, p["x"], p["ids"], p["lora"], p["enabled"],
                                 row_map=row_map)
            assert step.row_map is row_map and step.fast
            y2 = p["y2"].clone()
            h = p["h"] if row_map is None else mapped(p["h"], rmap)
            step.down(y2, h, p["tw"])
            outs.append((pair_rows(y13, rmap, row_map is not None), y2))
        layers[name] = outs
    for (y13_p, y2_p), (y13_m, y2_m) in zip(layers["pair"], layers["map"]):
        assert torch.equal(y13_m, y13_p) and torch.equal(y2_m, y2_p)
    assert torch.equal(layers["map"][0][1], layers["map"][1][1])  # the kept launch: same result


@pytest.mark.parametrize("layout", ["naive", "sorted"])
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("tokens", [4, 13])
def test_down_shrink_folded_into_the_gate_up_expand(layout, with_map, tokens):
    """``fold_down``: the gate_up expand that writes the activation also does the down shrink
    (partials per gate_up n-block, the last one partial here); the down op then launches its
    expand alone. Same activations bit for bit, the same down output up to the summation
    order, rows of slot 1 (no expert LoRA) and the padding pair untouched."""

    p = problem(tokens, 1, seed=50 + tokens)
    experts, hidden, inter, rank, slots = p["dims"]
    rmap = p["row_map"] if with_map else None
    base = forced_config(16, 2, 16, 32, naive=layout == "naive")
    outs = {}
    for fold in (False, True):
        cfg = dict(base, fold_down=fold)
        ops = MoELoRAOps(p["ids"], p["lora"], p["enabled"], experts, hidden, inter, rank, slots,
                         config=cfg)
        y13 = p["y13"].clone() if rmap is None else mapped(p["y13"], rmap)
        act = torch.zeros(y13.shape[0], inter, device=DEV)
        assert ops.add_w13(y13, p["x"], p["a13"], p["b13"], act=act, row_map=rmap,
                           down_a=p["a2"])
        assert (ops.down_part is not None) == fold
        swiglu_rows_without_lora(act, y13, p["ids"], p["lora"], p["enabled"], experts,
                                 row_map=rmap)
        y2 = p["y2"].clone()
        ops.add_w2(y2, act, p["a2"], p["b2"], p["tw"], row_map=rmap)
        assert (ops.launches2[0] is None) == fold  # no down shrink launched when folded
        outs[fold] = act, y2
    assert torch.equal(outs[True][0], outs[False][0])
    y2_plain, y2_fold = outs[False][1], outs[True][1]
    assert not torch.equal(y2_plain, p["y2"])  # the down delta is there
    # the same products summed in another grouping (tf32 tensor-core dots on a GPU)
    tol = 5e-3 if HAS_CUDA else 1e-5
    assert torch.allclose(y2_fold, y2_plain, rtol=tol, atol=tol)
    untouched = (p["lora"].cpu() < 0) | (p["lora"].cpu() == 1)  # no adapter / no expert LoRA
    rows = torch.nonzero(untouched.repeat_interleave(p["ids"].shape[1])).flatten()
    assert torch.equal(y2_fold[rows], p["y2"][rows])


def test_fold_down_switch(monkeypatch):
    """A config's ``fold_down``, or ``LORAPLEX_MOE_FOLD_DOWN`` for every naive layout."""
    from kernels.moe_lora.configs import FOLD_DOWN_ENV, folds_down

    monkeypatch.delenv(FOLD_DOWN_ENV, raising=False)
    assert not folds_down({}) and folds_down({"fold_down": True})
    monkeypatch.setenv(FOLD_DOWN_ENV, "1")
    assert folds_down({})


def test_layer_does_not_keep_the_launches_of_a_folded_step(monkeypatch):
    """A sorted layout with the fold on (``LORAPLEX_MOE_FOLD_DOWN``): ``MoELoRALayer`` keeps no
    launch of such a step (its expand writes the down's partials), so repeat steps go through
    ``MoELoRAOps`` again and give the unfolded layer's result each time."""
    import kernels.moe_lora.ops as ops_module
    from kernels.moe_lora.configs import FOLD_DOWN_ENV

    tokens = 13
    p = problem(tokens, 1, seed=8)
    experts, hidden, inter, rank, slots = p["dims"]
    config = forced_config(16, 2, 16, 32)
    monkeypatch.setattr(ops_module, "get_layer_config", lambda m, **kw: config)
    results = {}
    for fold in (False, True):
        if fold:
            monkeypatch.setenv(FOLD_DOWN_ENV, "1")
        layer = MoELoRALayer(p["a13"], p["b13"], p["a2"], p["b2"], experts, slots)
        outs = []
        for _ in range(2):
            y13 = p["y13"].clone()
            act = torch.zeros(y13.shape[0], inter, device=DEV)
            step = layer.gate_up(y13, p["x"], p["ids"], p["lora"], p["enabled"], act=act)
            assert step.act_done and step.fast is not fold
            assert (step.ops.down_part is not None) == fold
            swiglu_rows_without_lora(act, y13, p["ids"], p["lora"], p["enabled"], experts)
            y2 = p["y2"].clone()
            step.down(y2, act, p["tw"])
            outs.append(y2)
        assert (len(layer._up.plans) == 0) == fold
        results[fold] = outs
    tol = 5e-3 if HAS_CUDA else 1e-5
    for plain, folded in zip(results[False], results[True]):
        assert torch.allclose(folded, plain, rtol=tol, atol=tol)
