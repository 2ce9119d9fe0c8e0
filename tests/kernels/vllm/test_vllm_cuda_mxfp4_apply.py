"""``kernels.vllm.cuda.mxfp4._apply_unfused``: the unfused MXFP4 experts' ``apply`` with the
row moves done inside the two GEMMs instead of two gather copies, on expert-sorted rows (loraplex's
LoRA ops, through the routing's row map) or token-pair rows (vLLM's LoRA hooks).

Anywhere: with a PyTorch model of ``matmul_ogs``' gather / scatter / gammas semantics (as
triton_kernels' own reference implements them) and a sorting routing, the layer's output equals
a per-pair dense computation, with LoRA deltas that are pair-specific (so a row in the wrong
order would show) and hooks that see the tensors vLLM's hooks are given. On a GPU with vLLM 0.24
and ``triton_kernels``: the real ``matmul_ogs`` (bf16 experts) against vLLM's own ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kernels.vllm import cuda as vllm_cuda
from kernels.vllm.cuda import moe as vllm_cuda_moe
from kernels.vllm.cuda import mxfp4 as vllm_cuda_mxfp4
from kernels.vllm.cuda.oai import oai_module, unfused_class
from tests.helpers.vllm_gpu import needs_vllm024_gpu


@dataclass
class Indx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


def routing_of(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Pairs sorted by expert (stable), as triton_kernels' routing sorts them: ``src_indx[r]`` is
    the pair of sorted row r, ``dst_indx`` its inverse; ``gate_scal`` in sorted order."""
    experts = topk_ids.reshape(-1).long()
    src = torch.argsort(experts, stable=True)
    dst = torch.argsort(src)
    routing = SimpleNamespace(n_expts_act=topk_ids.shape[1],
                              expt_hist=torch.bincount(experts, minlength=num_experts),
                              gate_scal=topk_weights.reshape(-1)[src], experts=experts[src])
    return routing, Indx(src.int(), dst.int()), Indx(dst.int(), src.int())


def matmul_ogs_model(x, w, bias, routing, gather_indx=None, scatter_indx=None,
                     precision_config=None, gammas=None, y=None):
    """``matmul_ogs`` semantics over sorted rows r: input ``x[gather.src[r] // n_expts_act]``,
    expert ``routing.experts[r]``, ``(x w[e] + bias[e]) * gammas[r]``, written to
    ``y[scatter.dst[r]]`` (``n_expts_act == 1``) or summed into ``y[scatter.dst[r] // n]``."""
    n = routing.n_expts_act
    rows = gather_indx.src_indx.shape[0] if gather_indx is not None else x.shape[0]
    src = (gather_indx.src_indx.long() // n if gather_indx is not None
           else torch.arange(rows))
    e = routing.experts
    out = torch.einsum("rk,rkn->rn", x[src].float(), w[e].float()) + bias[e].float()
    if gammas is not None:
        out = out * gammas[:, None].float()
    y2d = y.view(-1, y.shape[-1])
    if scatter_indx is None:
        y2d.copy_(out.to(y.dtype))
    elif n == 1:
        y2d[scatter_indx.dst_indx.long()] = out.to(y.dtype)
    else:
        y2d.zero_().index_add_(0, scatter_indx.dst_indx.long() // n, out.to(y.dtype))
    return y


class LoRAContext(SimpleNamespace):
    """A stand-in for vLLM's ``MoELoRAContext`` (weakly referenceable, as that dataclass is)."""


def lora_context(step_has_lora: bool):
    """What ``_apply_unfused`` reads of vLLM's MoE LoRA context: the step's no-LoRA flag (a
    CPU tensor) and the first A stack (for the skip check: not tracked here, never skipped)."""
    meta = SimpleNamespace(no_lora_flag_cpu=torch.tensor(not step_has_lora))
    return LoRAContext(punica_wrapper=SimpleNamespace(token_mapping_meta=meta),
                       w13_lora_a_stacked=[torch.zeros(1)], local_token_lora_mapping=None,
                       fully_sharded=False, tp_size=1)  # a CPU stack: vLLM's hooks run


class Experts:
    """What ``_apply_unfused`` uses of vLLM's experts object, with LoRA hooks adding fixed
    per-pair deltas and recording what they are handed. ``lora``: None (no LoRA context), or
    whether the step has LoRA."""

    def __init__(self, b1, b2, delta13, delta2, lora: bool | None = True):
        self.quant_config = SimpleNamespace(w1_bias=b1, w2_bias=b2, w1_precision=None,
                                            w2_precision=None)
        self._lora_context = None if lora is None else lora_context(lora)
        self.delta13, self.delta2, self.seen = delta13, delta2, {}

    def _make_routing_data(self, topk_ids, topk_weights, num_experts):
        return routing_of(topk_ids, topk_weights, num_experts)

    def adjust_N_for_activation(self, n, activation):
        return n // 2

    def activation(self, activation, output, input):
        half = input.shape[-1] // 2
        output.copy_(torch.nn.functional.silu(input[:, :half]) * input[:, half:])

    def moe_sum(self, input, output):
        output.copy_(input.sum(1))

    def apply_w13_lora(self, ctx, *, y, x, topk_ids, topk_weights, expert_map, w1, w2,
                       num_tokens, top_k_num):
        self.seen["w13"] = (y.shape, x.data_ptr(), expert_map, num_tokens, top_k_num)
        y += self.delta13
        return ("step", None, None, None)

    def apply_w2_lora(self, ctx, *, y, x, topk_weights, sorted_token_ids_lora, expert_ids_lora,
                      num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2,
                      top_k_num):
        self.seen["w2"] = (y.shape, x.clone(), sorted_token_ids_lora)
        y += self.delta2.view_as(y) * topk_weights[..., None]


def dense_reference(x, w1, b1, w2, b2, topk_ids, topk_w, delta13, delta2):
    """Per pair p = (t, k): ``h = act(x_t W1_e + b1_e + d13_p)``, ``out_t += w (h W2_e + b2_e +
    d2_p)``; returns (out, h per pair)."""
    m, k = topk_ids.shape
    out = torch.zeros(m, w2.shape[-1])
    acts = []
    for p in range(m * k):
        t, e = p // k, int(topk_ids.view(-1)[p])
        h13 = x[t] @ w1[e] + b1[e] + delta13[p]
        half = h13.shape[-1] // 2
        h = torch.nn.functional.silu(h13[:half]) * h13[half:]
        acts.append(h)
        out[t] += topk_w.view(-1)[p] * (h @ w2[e] + b2[e] + delta2[p])
    return out, torch.stack(acts)


def fused_experts_model(output, hidden_states, w1, w2, routing, gather, scatter, *, topk,
                        activation, quant_config, global_num_experts, intermediate_cache,
                        a1q_scale, calls):
    """vLLM's fused path (``triton_kernel_fused_experts``) through the ``matmul_ogs`` model:
    w13 GEMM over expert-sorted rows with the activation (the test's), w2 GEMM summing each
    token's ``top-k`` rows with the routing weights into ``output``."""
    assert routing.n_expts_act == topk == gather.src_indx.shape[0] // hidden_states.shape[0]
    calls.append("fused")
    rows, n = gather.src_indx.shape[0], w1.shape[-1]
    y13 = matmul_ogs_model(hidden_states, w1, quant_config.w1_bias, routing, gather_indx=gather,
                           y=torch.empty(rows, n))
    act = torch.nn.functional.silu(y13[:, : n // 2]) * y13[:, n // 2:]
    matmul_ogs_model(act, w2, quant_config.w2_bias, routing, scatter_indx=scatter,
                     gammas=routing.gate_scal, y=output)


def loraplex_gate_up(monkeypatch, delta13):
    """loraplex's ops take the layer; their gate_up (``kernels.vllm.cuda.moe.unfused_gate_up``) adds the
    pair deltas at the rows the row map names, and records the map and what it was given."""
    seen = {}

    def unfused_gate_up(ctx, y13, act, x, topk_ids, row_map, swiglu):
        seen.update(row_map=row_map.clone(), shape=tuple(y13.shape), swiglu=swiglu)
        y13[row_map.long()] += delta13.to(y13.dtype)
        return ("sorted step", None, None, None), False

    monkeypatch.setattr(vllm_cuda_moe, "takes_layer", lambda ctx, x: True)
    monkeypatch.setattr(vllm_cuda_moe, "unfused_gate_up", unfused_gate_up)
    return seen


def oai_model(calls: list):
    return SimpleNamespace(
        matmul_ogs=matmul_ogs_model, FUSED_MOE_UNQUANTIZED_CONFIG=None,
        MoEActivation=SimpleNamespace(SWIGLUOAI="act"),
        triton_kernel_fused_experts=lambda *a, **kw: fused_experts_model(*a, **kw, calls=calls),
        _resize_cache=lambda buf, shape: buf.flatten()[:torch.Size(shape).numel()].view(shape))


@pytest.mark.parametrize("m,k,experts,lora,ours", [
    (5, 4, 6, True, False), (1, 2, 3, True, False), (5, 4, 6, True, True), (6, 3, 7, True, True),
    (7, 3, 5, None, False), (4, 2, 5, False, False)])
def test_unfused_apply_matches_per_pair_computation(monkeypatch, m, k, experts, lora, ours):
    """With expert LoRA in the step: the sorted-row path when loraplex's ops take the layer
    (gate_up through the row map, vLLM's down hook on the sorted activation), else the
    pair-order path with vLLM's hooks; without (no LoRA context, or a step without adapters):
    vLLM's fused path, no hook called. All equal the per-pair computation."""
    torch.manual_seed(m * 10 + k)
    hidden, n = 12, 10
    x = torch.randn(m, hidden)
    w1, b1 = torch.randn(experts, hidden, n), torch.randn(experts, n)
    w2, b2 = torch.randn(experts, n // 2, hidden), torch.randn(experts, hidden)
    topk_ids = torch.stack([torch.randperm(experts)[:k] for _ in range(m)]).int()
    topk_w = torch.rand(m, k)
    d13 = torch.randn(m * k, n) if lora else torch.zeros(m * k, n)
    d2 = torch.randn(m * k, hidden) if lora else torch.zeros(m * k, hidden)
    ex = Experts(b1, b2, d13, d2, lora=lora)
    calls = []
    monkeypatch.setattr(vllm_cuda_mxfp4, "oai_module", lambda: oai_model(calls))
    ours_seen = loraplex_gate_up(monkeypatch, d13) if ours else {}
    out = torch.full((m, hidden), float("nan"))
    ws13, ws2 = torch.empty(m * k * n), torch.empty(m * k * max(n, hidden))
    vllm_cuda_mxfp4._apply_unfused(ex, out, x, w1, w2, topk_w, topk_ids, "act", -1, None,
                                   None, None, ws13, ws2, None, False)
    want, acts = dense_reference(x, w1, b1, w2, b2, topk_ids, topk_w, d13, d2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    _, gather, _ = routing_of(topk_ids, topk_w, experts)
    if ours:  # gate_up got the sorted rows and their map; down the sorted activation
        assert ours_seen["shape"] == (m * k, n) and ours_seen["swiglu"]
        assert torch.equal(ours_seen["row_map"], gather.dst_indx)
        assert "w13" not in ex.seen and ex.seen["w2"][2] == "sorted step"
        torch.testing.assert_close(ex.seen["w2"][1], acts[gather.src_indx.long()], rtol=1e-4,
                                   atol=1e-4)
        assert calls == []
    elif lora:  # the hooks got vLLM's shapes, the hidden states, the activation in pair order
        assert ex.seen["w13"] == ((m * k, n), x.data_ptr(), None, m, k)
        assert ex.seen["w2"][0] == (m, k, hidden) and ex.seen["w2"][2] == "step"
        torch.testing.assert_close(ex.seen["w2"][1], acts, rtol=1e-4, atol=1e-4)
        assert calls == []
    else:
        assert ex.seen == {} and calls == ["fused"]


def test_other_activations_keep_the_unfused_path_in_steps_without_lora(monkeypatch):
    torch.manual_seed(3)
    m, k, experts, hidden, n = 3, 2, 4, 8, 6
    x = torch.randn(m, hidden)
    w1, b1 = torch.randn(experts, hidden, n), torch.randn(experts, n)
    w2, b2 = torch.randn(experts, n // 2, hidden), torch.randn(experts, hidden)
    topk_ids = torch.stack([torch.randperm(experts)[:k] for _ in range(m)]).int()
    topk_w = torch.rand(m, k)
    ex = Experts(b1, b2, None, None, lora=None)
    ex.quant_config.gemm1_clamp_limit = 5.0  # not the fused kernel's limit
    calls = []
    monkeypatch.setattr(vllm_cuda_mxfp4, "oai_module", lambda: oai_model(calls))
    out = torch.full((m, hidden), float("nan"))
    vllm_cuda_mxfp4._apply_unfused(ex, out, x, w1, w2, topk_w, topk_ids, "act", -1, None,
                                   None, None, torch.empty(m * k * n),
                                   torch.empty(m * k * max(n, hidden)), None, False)
    zeros13, zeros2 = torch.zeros(m * k, n), torch.zeros(m * k, hidden)
    want, _ = dense_reference(x, w1, b1, w2, b2, topk_ids, topk_w, zeros13, zeros2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert calls == []


def test_expert_parallel_calls_keep_vllms_apply(monkeypatch):
    calls = []
    monkeypatch.setitem(vllm_cuda_mxfp4._vllm, "apply", lambda *a: calls.append(a))
    args = [object()] * 15
    args[9] = torch.zeros(3)  # expert_map
    vllm_cuda_mxfp4._apply_unfused(*args, False)
    assert len(calls) == 1 and calls[0][9] is args[9]


@needs_vllm024_gpu
@pytest.mark.parametrize("m,step_has_lora,ours", [
    (1, True, False), (16, True, False), (200, True, False), (1, True, True), (16, True, True),
    (200, True, True), (16, False, False), (200, False, False)])
def test_real_matmul_ogs_matches_vllms_unfused_apply(monkeypatch, m, step_has_lora, ours):
    """bf16 experts through triton_kernels' ``matmul_ogs``: the sorted-row apply (``ours``:
    gate_up deltas through the row map) and the pair-order apply equal vLLM 0.24's
    ``UnfusedOAITritonExperts.apply`` on the same routing, LoRA deltas included; in a step
    without LoRA, loraplex's fused path equals vLLM's unfused apply without LoRA."""
    oai = oai_module()
    cls = unfused_class()
    assert cls is not None, "vLLM's unfused MXFP4 experts (triton_kernels) do not import on this GPU"
    original = vllm_cuda.PATCHES.original(cls, "apply") if vllm_cuda.PATCHES.active else cls.apply
    torch.manual_seed(m)
    dev, dt = "cuda", torch.bfloat16
    experts, k, hidden, n = 8, 4, 256, 512
    x = torch.randn(m, hidden, device=dev, dtype=dt)
    w1 = (torch.randn(experts, hidden, n, device=dev) / 16).to(dt)
    w2 = (torch.randn(experts, n // 2, hidden, device=dev) / 16).to(dt)
    b1 = torch.randn(experts, n, device=dev)
    b2 = torch.randn(experts, hidden, device=dev)
    logits = torch.randn(m, experts, device=dev)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), k)
    topk_ids = topk_ids.int()
    d13 = torch.randn(m * k, n, device=dev, dtype=dt)
    d2 = torch.randn(m * k, hidden, device=dev, dtype=dt)
    swiglu_oai = oai.MoEActivation.SWIGLUOAI  # GPT-OSS's: the one the fused path fuses
    outs = []
    if ours:
        loraplex_gate_up(monkeypatch, d13)
    for apply in (original, vllm_cuda_mxfp4._apply_unfused):
        mine = apply is vllm_cuda_mxfp4._apply_unfused
        # vLLM's apply without LoRA has no context at all; ours gets a step without adapters
        ex = Experts(b1, b2, d13, d2, lora=step_has_lora if mine or step_has_lora else None)
        ex._make_routing_data = lambda ids, w, e: oai.make_routing_data(ids, w, e)
        ex.activation = lambda act, out, inp: torch.ops._C.swigluoai_and_mul(out, inp, 1.702,
                                                                              7.0)
        out = torch.empty(m, hidden, device=dev, dtype=dt)
        ws13 = torch.empty(m * k * n, device=dev, dtype=dt)
        ws2 = torch.empty(m * k * max(n, hidden), device=dev, dtype=dt)
        apply(ex, out, x, w1, w2, topk_w, topk_ids, swiglu_oai, -1, None, None, None, ws13,
              ws2, None, False)
        outs.append(out.float())
        if mine:  # the down hook ran exactly when the step had LoRA, vLLM's gate_up when not ours
            assert ("w2" in ex.seen) == step_has_lora
            assert ("w13" in ex.seen) == (step_has_lora and not ours)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


@needs_vllm024_gpu
@pytest.mark.parametrize("m", [1, 16, 300])
def test_pair_order_steps_equal_the_lora_off_layer_on_mxfp4_weights(m):
    """Real MXFP4 experts (vLLM's weight layout): token gather + pair scatter, swiglu, pair-row
    w2 and ``moe_sum`` give the LoRA-off layer's output (fused swiglu, top-k sum in the GEMM);
    the layouts ``benchmarks.kernels.mxfp4_experts`` times."""
    from benchmarks.kernels.mxfp4_experts import (
        HIDDEN,
        INTER,
        layer_steps,
        mxfp4_experts,
    )

    assert unfused_class() is not None, \
        "vLLM's unfused MXFP4 experts (triton_kernels) do not import on this GPU"
    layers = [(*mxfp4_experts(2 * INTER, HIDDEN, 0), *mxfp4_experts(HIDDEN, INTER, 1))]
    _, err = layer_steps(m, layers, seed=m)
    assert err < 2e-2
