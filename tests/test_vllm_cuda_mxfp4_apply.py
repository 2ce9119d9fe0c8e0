"""``kernels.vllm_cuda_mxfp4._apply_pair_order``: the unfused MXFP4 experts' ``apply`` with the
row moves done inside the two GEMMs instead of two gather copies.

Anywhere: with a PyTorch model of ``matmul_ogs``' gather / scatter / gammas semantics (as
triton_kernels' own reference implements them) and a sorting routing, the layer's output equals
a per-pair dense computation, with LoRA hooks that add pair-specific deltas (so a row in the
wrong order would show) and see the tensors vLLM's hooks are given. On a GPU with vLLM 0.24 and
``triton_kernels``: the real ``matmul_ogs`` (bf16 experts) against vLLM's own ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kernels import vllm_cuda_mxfp4
from tests.vllm_gpu import needs_vllm024_gpu


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


class Experts:
    """What ``_apply_pair_order`` uses of vLLM's experts object, with LoRA hooks adding fixed
    per-pair deltas and recording what they are handed."""

    def __init__(self, b1, b2, delta13, delta2, lora=True):
        self.quant_config = SimpleNamespace(w1_bias=b1, w2_bias=b2, w1_precision=None,
                                            w2_precision=None)
        self._lora_context = object() if lora else None
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


@pytest.mark.parametrize("m,k,experts,lora", [(5, 4, 6, True), (1, 2, 3, True), (7, 3, 5, False)])
def test_pair_order_apply_matches_per_pair_computation(monkeypatch, m, k, experts, lora):
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
    monkeypatch.setattr(vllm_cuda_mxfp4, "_oai", lambda: SimpleNamespace(
        matmul_ogs=matmul_ogs_model, FUSED_MOE_UNQUANTIZED_CONFIG=None,
        _resize_cache=lambda buf, shape: buf.flatten()[:torch.Size(shape).numel()].view(shape)))
    out = torch.full((m, hidden), float("nan"))
    ws13, ws2 = torch.empty(m * k * n), torch.empty(m * k * max(n, hidden))
    vllm_cuda_mxfp4._apply_pair_order(ex, out, x, w1, w2, topk_w, topk_ids, "act", -1, None,
                                      None, None, ws13, ws2, None, False)
    want, acts = dense_reference(x, w1, b1, w2, b2, topk_ids, topk_w, d13, d2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    if lora:  # the hooks got vLLM's shapes, the hidden states, and the activation in pair order
        assert ex.seen["w13"] == ((m * k, n), x.data_ptr(), None, m, k)
        assert ex.seen["w2"][0] == (m, k, hidden) and ex.seen["w2"][2] == "step"
        torch.testing.assert_close(ex.seen["w2"][1], acts, rtol=1e-4, atol=1e-4)
    else:
        assert ex.seen == {}


def test_expert_parallel_calls_keep_vllms_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_cuda_mxfp4, "_original_apply", lambda *a: calls.append(a))
    args = [object()] * 15
    args[9] = torch.zeros(3)  # expert_map
    vllm_cuda_mxfp4._apply_pair_order(*args, False)
    assert len(calls) == 1 and calls[0][9] is args[9]


@needs_vllm024_gpu
@pytest.mark.parametrize("m", [1, 16, 200])
def test_real_matmul_ogs_matches_vllms_unfused_apply(m):
    """bf16 experts through triton_kernels' ``matmul_ogs``: the pair-order apply equals vLLM
    0.24's ``UnfusedOAITritonExperts.apply`` on the same routing, LoRA hooks included."""
    oai = vllm_cuda_mxfp4._oai()
    cls = vllm_cuda_mxfp4._unfused_class()
    if cls is None:
        pytest.skip("triton_kernels not importable")
    original = vllm_cuda_mxfp4._original_apply or cls.apply
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
    outs = []
    for apply in (original, vllm_cuda_mxfp4._apply_pair_order):
        ex = Experts(b1, b2, d13, d2)
        ex._make_routing_data = lambda ids, w, e: oai.make_routing_data(ids, w, e)
        out = torch.empty(m, hidden, device=dev, dtype=dt)
        ws13 = torch.empty(m * k * n, device=dev, dtype=dt)
        ws2 = torch.empty(m * k * max(n, hidden), device=dev, dtype=dt)
        apply(ex, out, x, w1, w2, topk_w, topk_ids, "act", -1, None, None, None, ws13, ws2,
              None, False)
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


@needs_vllm024_gpu
@pytest.mark.parametrize("m", [1, 16, 300])
def test_pair_order_steps_equal_the_lora_off_layer_on_mxfp4_weights(m):
    """Real MXFP4 experts (vLLM's weight layout): token gather + pair scatter, swiglu, pair-row
    w2 and ``moe_sum`` give the LoRA-off layer's output (fused swiglu, top-k sum in the GEMM);
    the layouts ``benchmarks.mxfp4_experts_steps`` times."""
    from benchmarks.mxfp4_experts_steps import HIDDEN, INTER, layer_steps, mxfp4_experts

    if vllm_cuda_mxfp4._unfused_class() is None:
        pytest.skip("triton_kernels not importable")
    layers = [(*mxfp4_experts(2 * INTER, HIDDEN, 0), *mxfp4_experts(HIDDEN, INTER, 1))]
    _, err = layer_steps(m, layers, seed=m)
    assert err < 2e-2
