"""The vLLM 0.24 CUDA integration: version gate and glue (anywhere) and, on a GPU with vLLM 0.24,
the patched ``LoRAExpertsMixin`` methods and loraplex's punica wrapper against vLLM's own on the
same inputs."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.shapes import GPT_OSS_20B, RANK, SLOTS
from kernels.vllm import cuda
from kernels.vllm.cuda import moe as vllm_cuda
from kernels.vllm.cuda import warmup as vllm_cuda_warmup
from kernels.vllm.patching import ObjectMap
from kernels.vllm.versions import CUDA, UnsupportedVLLMError, require
from tests.helpers.vllm_gpu import needs_vllm024_gpu


class LoRAContext(SimpleNamespace):
    """A stand-in for vLLM's ``MoELoRAContext`` (weakly referenceable, as that dataclass is)."""


@pytest.mark.parametrize("version", ["0.32.0", "0.23.1", "0.25.0", "0.240.0", "1.0.0"])
def test_refuses_other_vllm_versions(version):
    with pytest.raises(UnsupportedVLLMError, match="LORAPLEX_MOE_LORA=0"):
        require(CUDA, cuda.WHAT, version=version)


def test_accepts_024():
    assert require(CUDA, cuda.WHAT, version="0.24.0") == "0.24.0"
    assert require(CUDA, cuda.WHAT, version="0.24.1") == "0.24.1"


def test_install_refuses_another_vllm_and_changes_nothing(monkeypatch):
    import vllm
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    before = LoRAExpertsMixin.apply_w13_lora
    monkeypatch.setattr(vllm, "__version__", "0.25.0")
    with pytest.raises(UnsupportedVLLMError, match="0.25.0"):
        cuda.install()
    assert not cuda.installed() and LoRAExpertsMixin.apply_w13_lora is before


@needs_vllm024_gpu
@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("num_tokens", [3, 40, 300])
def test_patched_methods_match_vllm(num_slices, num_tokens, seed):
    from types import SimpleNamespace

    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    dev = torch.device("cuda")
    H, I, E, K, L, r = 512, 384, 16, 4, 4, 32
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s, std):
        return (torch.randn(*s, device=dev, generator=gen) * std).to(torch.bfloat16)

    n13 = 2 * I // num_slices
    a13 = tuple(rnd(L, E, r, H, std=H**-0.5) for _ in range(num_slices))
    b13 = tuple(rnd(L, E, n13, r, std=r**-0.5) for _ in range(num_slices))
    a2, b2 = rnd(L, E, r, I, std=I**-0.5), rnd(L, E, H, r, std=r**-0.5)
    enabled = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32, device=dev)  # slot 1: no experts
    for t in (*a13, *b13, a2, b2):
        t[1].zero_()  # vLLM keeps zeros in a slot without expert LoRA
    slot = torch.randint(-1, L, (num_tokens,), device=dev, generator=gen).to(torch.int32)
    slot[0] = 0
    pw = PunicaWrapperGPU(4096, 256, dev,
                          lora_config=SimpleNamespace(max_loras=L, specialize_active_lora=False))
    pw.token_mapping_meta.prepare_tensors(slot)
    ctx = MoELoRAContext(
        w13_lora_a_stacked=a13, w13_lora_b_stacked=b13, w2_lora_a_stacked=(a2,),
        w2_lora_b_stacked=(b2,), adapter_enabled=enabled, max_loras=L, top_k=K,
        w13_num_slices=num_slices, fully_sharded=False, tp_rank=0, tp_size=1,
        local_num_experts=E, punica_wrapper=pw, use_tuned_config=False)
    ids = torch.rand(num_tokens, E, device=dev, generator=gen).argsort(1)[:, :K].to(torch.int32)
    tw = torch.softmax(torch.randn(num_tokens, K, device=dev, generator=gen), -1)
    x = rnd(num_tokens, H, std=1.0)
    h = rnd(num_tokens * K, I, std=1.0)
    w1 = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, device=dev, dtype=torch.bfloat16)
    y13_0 = rnd(num_tokens, K, 2 * I, std=0.1)
    y2_0 = rnd(num_tokens, K, H, std=0.1)
    mixin = LoRAExpertsMixin()

    def run():
        y13, y2 = y13_0.clone(), y2_0.clone()
        meta = mixin.apply_w13_lora(ctx, y=y13, x=x, topk_ids=ids, topk_weights=tw,
                                    expert_map=None, w1=w1, w2=w2, num_tokens=num_tokens,
                                    top_k_num=K)
        mixin.apply_w2_lora(ctx, y=y2, x=h, topk_weights=tw, sorted_token_ids_lora=meta[0],
                            expert_ids_lora=meta[1], num_tokens_post_padded_lora=meta[2],
                            token_lora_mapping=meta[3], num_tokens=num_tokens, w1=w1, w2=w2,
                            top_k_num=K)
        torch.cuda.synchronize()
        return (y13.float() - y13_0.float()), (y2.float() - y2_0.float())

    want13, want2 = run()
    cuda.install()
    try:
        got13, got2 = run()
    finally:
        cuda.uninstall()
    for got, want in ((got13, want13), (got2, want2)):
        assert want.norm() > 0
        assert float((got - want).norm() / want.norm()) < 2e-2


def _triton_device(monkeypatch) -> str:
    """Where the glue tests run the kernels: the GPU, else the CPU through the Triton
    interpreter (the test session imported triton under it: tests/conftest.py)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_patched_methods_compute_the_lora_deltas(monkeypatch, seed):
    """The glue (meta from the punica wrapper, views of vLLM's caches, slices, skip) on any
    device: on CPU through the Triton interpreter, with a stand-in for vLLM's context."""
    dev = _triton_device(monkeypatch)
    H, I, E, K, L, r, T = 40, 24, 5, 2, 3, 8, 7
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dev)

    a13 = (rnd(L, E, r, H, std=H**-0.5), rnd(L, E, r, H, std=H**-0.5))  # gate, up
    b13 = (rnd(L, E, I, r, std=r**-0.5), rnd(L, E, I, r, std=r**-0.5))
    a2, b2 = rnd(L, E, r, I, std=I**-0.5), rnd(L, E, H, r, std=r**-0.5)
    token_lora = torch.tensor([0, -1, 2, 1, 0, 2, -1], dtype=torch.int32, device=dev)
    no_lora = torch.tensor([False])
    # vLLM 0.24's ``LoRAKernelMeta`` fields the MoE path reads
    meta = SimpleNamespace(token_lora_mapping=token_lora, no_lora_flag_cpu=no_lora)
    pw = SimpleNamespace(token_mapping_meta=meta)
    ctx = LoRAContext(w13_lora_a_stacked=a13, w13_lora_b_stacked=b13,
                          w2_lora_a_stacked=(a2,), w2_lora_b_stacked=(b2,),
                          adapter_enabled=torch.tensor([1, 1, 1, 0], dtype=torch.int32,
                                                       device=dev),
                          max_loras=L, local_num_experts=E, fully_sharded=False, tp_size=1,
                          local_token_lora_mapping=None, punica_wrapper=pw)
    monkeypatch.setattr(vllm_cuda, "_ours_applies", lambda c, x, em: True)
    monkeypatch.setattr(vllm_cuda_warmup, "WARM_UP_MS", (1, 3))
    monkeypatch.setattr(vllm_cuda_warmup, "_warmed", set())
    monkeypatch.setattr(vllm_cuda_warmup, "_done_contexts", ObjectMap())
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids = ids.to(dev)
    tw = torch.softmax(rnd(T, K), -1)
    x, h = rnd(T, H), rnd(T * K, I)
    y13, y2 = rnd(T, K, 2 * I), rnd(T, K, H)
    want13, want2 = y13.double().clone(), y2.double().clone()
    for t in range(T):
        a = int(token_lora[t])
        if a < 0:
            continue
        for k in range(K):
            e = int(ids[t, k])
            for s in range(2):
                want13[t, k, s * I:(s + 1) * I] += (x[t].double() @ a13[s][a, e].double().t()
                                                    ) @ b13[s][a, e].double().t()
            want2[t, k] += (tw[t, k].double() * (h[t * K + k].double() @ a2[a, e].double().t())
                            @ b2[a, e].double().t())
    # vLLM's LoRA setup of the layer (set_mapping) runs the original, then warms the kernels up
    ctx.top_k = K
    monkeypatch.setattr(vllm_cuda, "_ctx_supported", lambda c: True)
    mapped = []
    layer = SimpleNamespace(_moe_kernel=SimpleNamespace(
        fused_experts=SimpleNamespace(_lora_context=ctx)))
    vllm_cuda.warm_up_after(lambda s, p: mapped.append(p))(layer, pw)
    assert mapped == [pw] and len(vllm_cuda_warmup._warmed) == 1
    # without that hook, the first call warms up even when its batch has no adapter
    vllm_cuda_warmup._warmed.clear()
    vllm_cuda_warmup._done_contexts.clear()
    no_lora[0] = True
    skipped = vllm_cuda._apply_w13_lora(None, ctx, y=y13, x=x, topk_ids=ids, topk_weights=tw,
                                        expert_map=None, w1=None, w2=None, num_tokens=T,
                                        top_k_num=K)
    assert skipped[0] is vllm_cuda._SKIP and len(vllm_cuda_warmup._warmed) == 1
    no_lora[0] = False
    out = vllm_cuda._apply_w13_lora(None, ctx, y=y13, x=x, topk_ids=ids, topk_weights=tw,
                                    expert_map=None, w1=None, w2=None, num_tokens=T,
                                    top_k_num=K)
    vllm_cuda._apply_w2_lora(None, ctx, y=y2, x=h, topk_weights=tw, sorted_token_ids_lora=out[0],
                             expert_ids_lora=out[1], num_tokens_post_padded_lora=out[2],
                             token_lora_mapping=out[3], num_tokens=T, w1=None, w2=None,
                             top_k_num=K)
    tol = 5e-3 if dev == "cuda" else 1e-5
    for got, want in ((y13, want13), (y2, want2)):
        assert float((got.double() - want).norm() / want.norm()) < tol
    # a batch without LoRA tokens: both ops leave the caches alone
    no_lora[0] = True
    before = y13.clone()
    out = vllm_cuda._apply_w13_lora(None, ctx, y=y13, x=x, topk_ids=ids, topk_weights=tw,
                                    expert_map=None, w1=None, w2=None, num_tokens=T,
                                    top_k_num=K)
    assert torch.equal(y13, before)
    assert vllm_cuda._apply_w2_lora(None, ctx, y=y2, x=h, topk_weights=tw,
                                    sorted_token_ids_lora=out[0], expert_ids_lora=None,
                                    num_tokens_post_padded_lora=None, token_lora_mapping=None,
                                    num_tokens=T, w1=None, w2=None, top_k_num=K) is None


def test_compiles_after_the_warm_up_are_reported_and_chained(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen, pre_seen = [], []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook",
                        lambda **kw: pre_seen.append(kw["key"]))
    monkeypatch.setattr(vllm_cuda_warmup, "_watching", False)
    monkeypatch.setattr(vllm_cuda_warmup, "_warmed", set())
    monkeypatch.setattr(vllm_cuda_warmup, "_done", [])
    monkeypatch.setattr(vllm_cuda_warmup, "COMPILES_DURING_SERVING", [])
    monkeypatch.setattr(vllm_cuda_warmup, "OTHER_COMPILES", [])
    vllm_cuda_warmup.watch_compiles()
    pre, hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    ours = SimpleNamespace(name="kernels.moe_lora.launch._moe_lora_shrink_kernel")
    other = SimpleNamespace(name="triton_kernels.matmul_ogs._matmul_ogs")
    assert not pre(fn=ours, key="k0")  # a true value would make Triton skip the compile
    hook(fn=ours, key="k0")  # before any warm-up: the warm-up's own compiles
    vllm_cuda_warmup._warmed.add(("shape",))
    assert not pre(fn=other, key="k1")
    time.sleep(0.02)
    hook(fn=other, key="k1")
    hook(fn=ours, key="k2")  # no pre-hook call seen: duration unknown, still reported
    assert vllm_cuda_warmup.COMPILES_DURING_SERVING == [ours.name]
    [(name, seconds, key)] = vllm_cuda_warmup.OTHER_COMPILES
    assert name == other.name and 0.02 <= seconds < 5 and key == "k1"
    assert [kw["key"] for kw in seen] == ["k0", "k1", "k2"]  # vLLM's hooks still see them all
    assert pre_seen == ["k0", "k1"]


@needs_vllm024_gpu
@pytest.mark.parametrize("op", ["qkv", "o", "router"])
@pytest.mark.parametrize("num_tokens", [1, 16, 300, 1616])
@pytest.mark.parametrize("add_inputs", [True, False])
def test_dense_add_lora_linear_matches_vllm(op, num_tokens, add_inputs):
    """loraplex's punica wrapper's ``add_lora_linear`` vs vLLM's ``PunicaWrapperGPU`` on the same
    inputs and the same per-step metadata (GPT-OSS-20B attention / router widths, 8 slots,
    rank 32)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from kernels.vllm.cuda.punica import LoraplexPunicaWrapper

    dev = torch.device("cuda")
    L, r = SLOTS, RANK
    k, slices = GPT_OSS_20B.dense_ops()[op]
    g = torch.Generator(device=dev).manual_seed(num_tokens + len(slices))
    config = LoRAConfig(max_lora_rank=r, max_loras=L)
    stock, ours = (cls(8192, 256, dev, lora_config=config)
                   for cls in (PunicaWrapperGPU, LoraplexPunicaWrapper))
    lora = torch.randint(-1, L, (num_tokens,), generator=g, device=dev, dtype=torch.int32)
    lora[0] = 3
    for pw in (stock, ours):
        pw.token_mapping_meta.prepare_tensors(lora)
    a = tuple(torch.randn(L, 1, r, k, generator=g, device=dev, dtype=torch.bfloat16) * k**-0.5
              for _ in slices)
    b = tuple(torch.randn(L, 1, n, r, generator=g, device=dev, dtype=torch.bfloat16)
              for n in slices)
    x = torch.randn(num_tokens, k, generator=g, device=dev, dtype=torch.bfloat16)
    y0 = torch.randn(num_tokens, sum(slices), generator=g, device=dev, dtype=torch.bfloat16)
    if not add_inputs:
        y0.zero_()  # vLLM's dual-stream path hands a zeroed output

    def run(pw):
        y = y0.clone()
        pw.add_lora_linear(y, x, a, b, 1.0, slices, add_inputs=add_inputs)
        torch.cuda.synchronize()
        return y.float()

    want = run(stock)
    cuda.install()
    try:
        got = run(ours)
    finally:
        cuda.uninstall()
    delta_want, delta_got = want - y0.float(), got - y0.float()
    assert delta_want.norm() > 0
    assert float((delta_got - delta_want).norm() / delta_want.norm()) < 2e-2
    no_adapter = (lora < 0).cpu()
    assert torch.equal(got.cpu()[no_adapter], y0.float().cpu()[no_adapter])


def test_merged_column_apply_goes_through_add_lora_linear_with_one_rank(monkeypatch):
    """q/k/v and gate/up layers: vLLM's ``_mcp_apply`` zero-fills a buffer and calls shrink and
    expand itself; with one rank the patched apply hands the layer's stacks to
    ``add_lora_linear`` (our ops) and returns the base output with the delta added in place."""
    from kernels.vllm.cuda import dense as vllm_cuda_dense

    calls = []
    w = torch.randn(6, 4)

    def add_lora_linear(y, x, a, b, scale, slices):
        calls.append((y.shape, x.shape, a, b, scale, slices))
        y += 1.0

    layer = SimpleNamespace(
        tp_size=1, base_layer="base", lora_a_stacked=("a",), lora_b_stacked=("b",),
        output_slices=(4, 1, 1),
        _get_quant_method=lambda: SimpleNamespace(apply=lambda base, x, bias: x @ w),
        punica_wrapper=SimpleNamespace(add_lora_linear=add_lora_linear))
    x = torch.randn(2, 3, 6)
    out = vllm_cuda_dense._mcp_apply(x, None, layer)
    assert out.shape == (2, 3, 4) and torch.allclose(out, x @ w + 1.0)
    assert calls == [((6, 4), (6, 6), ("a",), ("b",), 1.0, (4, 1, 1))]
    sharded = SimpleNamespace(tp_size=2)
    monkeypatch.setitem(vllm_cuda_dense._vllm, "_mcp_apply", lambda x, bias, layer: "vllm's own")
    assert vllm_cuda_dense._mcp_apply(x, None, sharded) == "vllm's own"


def _gate_up_case(dev: str, tokens: int, mapped: bool, token_lora: list[int]):
    """A GPT-OSS-like MoE layer's LoRA context (slot 1 without expert LoRA), its inputs and
    the expected activation of every row: ``(ctx, x, y13, ids, row_map, rows, want_act)``;
    ``rows``: where pair ``p``'s rows of ``y13`` / ``act`` are."""
    H, I, E, K, L, r, T = 40, 24, 5, 2, 3, 8, tokens
    g = torch.Generator().manual_seed(tokens)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dev)

    a13, b13 = (rnd(L, E, r, H, std=H**-0.5),), (rnd(L, E, 2 * I, r, std=r**-0.5),)
    lora = torch.tensor(token_lora, dtype=torch.int32, device=dev)[:T]
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=dev)  # slot 1: no expert LoRA
    meta = SimpleNamespace(token_lora_mapping=lora, no_lora_flag_cpu=torch.tensor([False]))
    ctx = LoRAContext(w13_lora_a_stacked=a13, w13_lora_b_stacked=b13,
                          w2_lora_a_stacked=(rnd(L, E, r, I),),
                          w2_lora_b_stacked=(rnd(L, E, H, r),),
                          adapter_enabled=enabled, max_loras=L, local_num_experts=E,
                          punica_wrapper=SimpleNamespace(token_mapping_meta=meta))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids = ids.to(dev)
    spare = 1 if mapped else 0
    x, y13 = rnd(T, H), rnd(T * K + spare, 2 * I, std=3.0)
    row_map = (torch.randperm(T * K + spare, generator=g)[: T * K].to(torch.int32).to(dev)
               if mapped else None)
    rows = row_map.long() if mapped else torch.arange(T * K, device=dev)
    want = y13[rows].double().clone()
    for p in range(T * K):
        t, a = p // K, int(lora[p // K])
        if a >= 0 and int(enabled[a]):
            e = int(ids[t, p % K])
            want[p] += (x[t].double() @ a13[0][a, e].double().t()) @ b13[0][a, e].double().t()
    gate = want[:, 0::2].clamp(max=7.0)
    up = want[:, 1::2].clamp(-7.0, 7.0)
    return ctx, x, y13, ids, row_map, rows, gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _act_error(act: torch.Tensor, rows: torch.Tensor, want_act: torch.Tensor) -> float:
    return float((act[rows].double() - want_act).norm() / want_act.norm())


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("tokens", [3, 7])  # a naive layout (6 rows), a sorted one (14 rows)
def test_unfused_gate_up_folds_gpt_oss_activation(monkeypatch, tokens, mapped):
    """``unfused_gate_up`` (the MXFP4 experts' gate_up): every row's GPT-OSS swiglu of the
    w13 output (gate/up interleaved) plus its LoRA delta, from the expand for rows with expert
    LoRA and from the complement kernel for the others (no adapter, a slot without expert LoRA);
    twice, so a repeat step takes the layer's kept launches. ``mapped``: the rows of ``y13`` and
    ``act`` in another order (a row map, as the GEMM's expert-sorted rows; one spare row that
    nothing maps to). Interpreter on CPU."""
    dev = _triton_device(monkeypatch)
    monkeypatch.setattr(vllm_cuda, "_ours_applies", lambda c, x, em: True)
    monkeypatch.setattr(vllm_cuda, "warm_up_layer", lambda c, k: None)
    ctx, x, y13, ids, row_map, rows, want_act = _gate_up_case(dev, tokens, mapped,
                                                              [0, -1, 2, 1, 0, 2, -1])
    for _ in range(2):
        act = torch.full((y13.shape[0], want_act.shape[1]), float("nan"), device=dev)
        before = y13.clone()
        step, done = vllm_cuda.unfused_gate_up(ctx, y13, act, x, ids, row_map, swiglu=True)
        assert done and step[0].act_done and step[0].row_map is row_map
        assert torch.equal(y13, before)  # the expand wrote act, not the GEMM output
        assert _act_error(act, rows, want_act) < (5e-3 if dev == "cuda" else 1e-5)
        if mapped:  # the spare row: nothing written
            spare_row = sorted(set(range(y13.shape[0])) - set(rows.tolist()))
            assert act[spare_row].isnan().all()


@pytest.mark.parametrize("every", [True, False])
def test_unfused_gate_up_skips_the_complement_when_every_token_has_expert_lora(monkeypatch,
                                                                               every):
    """A step whose tokens are all on slots with expert LoRA (as ``vllm_cuda_live`` recorded
    it) launches no kernel for rows without LoRA: the expand wrote every row. With one token
    without adapter the complement runs. Interpreter on CPU."""
    from kernels.moe_lora import activation as triton_moe_lora_act
    from kernels.vllm.cuda import live as vllm_cuda_live

    dev = _triton_device(monkeypatch)
    monkeypatch.setattr(vllm_cuda, "_ours_applies", lambda c, x, em: True)
    monkeypatch.setattr(vllm_cuda, "warm_up_layer", lambda c, k: None)
    lora = [0, 2, 2, 0, 0, 2, 0] if every else [0, 2, -1, 0, 0, 2, 0]
    ctx, x, y13, ids, row_map, rows, want_act = _gate_up_case(dev, 7, True, lora)
    monkeypatch.setattr(vllm_cuda_live, "_live", {ctx.w13_lora_a_stacked[0].data_ptr(): {0, 2}})
    monkeypatch.setattr(vllm_cuda_live, "_step", {})
    vllm_cuda_live.record_step([{0: 7, 2: 9, -1: 0}[v] for v in lora], [7, 8, 9])
    calls = []
    real = triton_moe_lora_act.swiglu_rows_without_lora
    monkeypatch.setattr(triton_moe_lora_act, "swiglu_rows_without_lora",
                        lambda *a, **k: (calls.append(1), real(*a, **k)))
    act = torch.full((y13.shape[0], want_act.shape[1]), float("nan"), device=dev)
    _, done = vllm_cuda.unfused_gate_up(ctx, y13, act, x, ids, row_map, swiglu=True)
    assert done and len(calls) == (0 if every else 1)
    assert _act_error(act, rows, want_act) < (5e-3 if dev == "cuda" else 1e-5)
