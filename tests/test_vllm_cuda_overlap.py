"""``kernels.vllm_cuda_overlap``: the hooks' install/uninstall and pass-through (anywhere) and, on a
GPU with vLLM 0.24, an MoE layer call captured in a CUDA graph with each projection's LoRA on the
second stream: the replay equals the sequential eager call, also after new inputs, and both LoRA
branches were forked."""

from __future__ import annotations

import pytest
import torch

from kernels import vllm_cuda_overlap as overlap
from tests.vllm_gpu import needs_vllm024_gpu


class _Base:
    def activation(self, act, output, input):
        output.copy_(input)


class _Experts(_Base):
    _lora_context = None

    def apply(self, output, hidden_states):
        output.copy_(hidden_states * 2)


def test_install_wraps_own_and_inherited_methods_and_uninstall_restores_them():
    own_apply = _Experts.__dict__["apply"]
    overlap.install((_Experts,), lambda *a: pytest.fail("no plan outside a capture"), object())
    try:
        assert _Experts.__dict__["apply"] is not own_apply
        assert "activation" in _Experts.__dict__  # the inherited one, wrapped on the class
        overlap.install((_Experts,), None, None)  # idempotent: wraps once
        e, out, h = _Experts(), torch.zeros(3), torch.ones(3)
        e.apply(out, hidden_states=h)  # not capturing: the original, no plan asked
        assert out.tolist() == [2.0, 2.0, 2.0]
        e.activation(None, out, torch.full((3,), 5.0))  # no branches: the original only
        assert out.tolist() == [5.0, 5.0, 5.0]
    finally:
        overlap.uninstall()
    assert _Experts.__dict__["apply"] is own_apply
    assert "activation" not in _Experts.__dict__


def test_switch_is_off_unless_set(monkeypatch):
    monkeypatch.delenv(overlap.SWITCH_ENV, raising=False)
    assert not overlap.enabled()
    for value, on in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv(overlap.SWITCH_ENV, value)
        assert overlap.enabled() is on


@needs_vllm024_gpu
@pytest.mark.parametrize("num_tokens", [16, 40])
def test_captured_layer_with_lora_branches_equals_the_sequential_call(monkeypatch, num_tokens):
    from types import SimpleNamespace

    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
        LoRAExpertsMixin,
    )

    from kernels import vllm_cuda

    dev = torch.device("cuda")
    H, I, E, K, L, r, M = 512, 384, 16, 4, 4, 32, num_tokens
    gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**30, ()).item()))

    def rnd(*s, std):
        return (torch.randn(*s, device=dev, generator=gen) * std).to(torch.bfloat16)

    a13, b13 = rnd(L, E, r, H, std=H**-0.5), rnd(L, E, 2 * I, r, std=r**-0.5)
    a2, b2 = rnd(L, E, r, I, std=I**-0.5), rnd(L, E, H, r, std=r**-0.5)
    w1, w2 = rnd(E, 2 * I, H, std=H**-0.5), rnd(E, H, I, std=I**-0.5)
    enabled = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32, device=dev)
    for t in (a13, b13, a2, b2):
        t[1].zero_()
    slot = torch.randint(-1, L, (M,), device=dev, generator=gen).to(torch.int32)
    slot[0] = 0
    pw = PunicaWrapperGPU(4096, 256, dev,
                          lora_config=SimpleNamespace(max_loras=L, specialize_active_lora=False))
    pw.token_mapping_meta.prepare_tensors(slot)
    ctx = MoELoRAContext(
        w13_lora_a_stacked=(a13,), w13_lora_b_stacked=(b13,), w2_lora_a_stacked=(a2,),
        w2_lora_b_stacked=(b2,), adapter_enabled=enabled, max_loras=L, top_k=K,
        w13_num_slices=1, fully_sharded=False, tp_rank=0, tp_size=1, local_num_experts=E,
        punica_wrapper=pw, use_tuned_config=False)

    class Experts(LoRAExpertsMixin):
        """vLLM's expert call order (base GEMM, w13 hook, activation, base GEMM, w2 hook, sum)
        with torch GEMMs for the base."""

        quant_dtype = None

        def activation(self, act, output, input, **kwargs):
            gate, up = input.view(-1, 2 * I).chunk(2, dim=-1)
            output.copy_(torch.nn.functional.silu(gate) * up)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                  workspace2, expert_tokens_meta, apply_router_weight_on_input):
            m, k = topk_ids.shape
            rows = topk_ids.reshape(-1).long()
            xr = hidden_states.repeat_interleave(k, 0)
            c1 = torch.bmm(w1[rows], xr.unsqueeze(-1)).squeeze(-1).view(m, k, -1)
            meta = self.apply_w13_lora(self._lora_context, y=c1, x=hidden_states,
                                       topk_ids=topk_ids, topk_weights=topk_weights,
                                       expert_map=None, w1=w1, w2=w2, num_tokens=m,
                                       top_k_num=k)
            c2 = torch.empty(m * k, I, device=dev, dtype=torch.bfloat16)
            self.activation(activation, c2, c1.view(m * k, -1))
            c3 = (torch.bmm(w2[rows], c2.unsqueeze(-1)).squeeze(-1).view(m, k, -1)
                  * topk_weights.unsqueeze(-1).to(torch.bfloat16))
            self.apply_w2_lora(self._lora_context, y=c3, x=c2, topk_weights=topk_weights,
                               sorted_token_ids_lora=meta[0], expert_ids_lora=meta[1],
                               num_tokens_post_padded_lora=meta[2],
                               token_lora_mapping=meta[3], num_tokens=m, w1=w1, w2=w2,
                               top_k_num=k)
            output.copy_(c3.float().sum(1).to(output.dtype))

    experts = Experts()
    experts.set_lora_context(ctx)
    ids = torch.rand(M, E, device=dev, generator=gen).argsort(1)[:, :K].to(torch.int32)
    tw = torch.softmax(torch.randn(M, K, device=dev, generator=gen), -1)
    x = rnd(M, H, std=1.0)
    out = torch.zeros(M, H, device=dev, dtype=torch.bfloat16)

    def call():
        experts.apply(output=out, hidden_states=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids,
                      activation=None, global_num_experts=E, expert_map=None, a1q_scale=None,
                      a2_scale=None, workspace13=None, workspace2=None,
                      expert_tokens_meta=None, apply_router_weight_on_input=False)

    forks = []
    fork_down = overlap.Branches.fork_down
    monkeypatch.setattr(overlap.Branches, "fork_down",
                        lambda self, *a: (forks.append(1), fork_down(self, *a))[1])
    vllm_cuda.install()
    overlap.install((Experts,), vllm_cuda._overlap_plan, vllm_cuda._SKIP)
    def eager(with_lora: bool) -> torch.Tensor:
        on = ctx.adapter_enabled.clone()
        if not with_lora:
            ctx.adapter_enabled.zero_()  # no slot with expert LoRA: the base alone
        call()
        torch.cuda.synchronize()
        ctx.adapter_enabled.copy_(on)
        return out.clone()

    try:
        want, base = eager(True), eager(False)  # sequential; compiles before the capture
        assert not forks
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        assert forks == [1]
        for fresh in (False, True):
            if fresh:  # new inputs in place: the replay follows them
                x.copy_(rnd(M, H, std=1.0))
                want, base = eager(True), eager(False)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            delta = (want.float() - base.float()).norm()
            assert delta > 0.05 * base.float().norm()  # the LoRA matters in this layer
            assert float((out.float() - want.float()).norm() / delta) < 2e-2
    finally:
        overlap.uninstall()
        vllm_cuda.uninstall()
