"""loraplex's vLLM-CPU 0.32 integration: MoE-expert LoRA applied inside vLLM, checked against
transformers (+ PEFT) greedy output in fp32; plus the plugin's guards and the capability check.

One in-process vLLM engine for the module (enable_lora, all modules targeted, fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adapters_registry.peft_layouts import ADAPTER_WEIGHTS, convert_adapter_dir
from kernels.reference import moe_lora_reference, random_moe_lora_problem
from kernels.vllm import capabilities
from tests.helpers import hf_reference as ref
from tests.helpers.expert_lora import (
    greedy_with,
    merged_model,
    write_per_expert_adapter,
)
from tests.helpers.vllm_gpu import vllm_cpu_only

pytestmark = vllm_cpu_only

PROMPTS = ["Hello world, please write the answer", "The expert adapter will route 42 tokens"]
MAX_NEW_TOKENS = 12


# ---------------------------------------------------------------- capability and guards (no engine)


def test_capability_on_by_default_on_cpu(monkeypatch):
    monkeypatch.delenv("LORAPLEX_MOE_LORA", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert capabilities.engine_applies_expert_lora()
    assert capabilities.expert_lora_unavailable_reason() is None
    capabilities.require_expert_lora("acme-experts")  # does not raise


def test_capability_off_when_switched_off(monkeypatch):
    monkeypatch.setenv("LORAPLEX_MOE_LORA", "0")
    assert not capabilities.engine_applies_expert_lora()
    assert "LORAPLEX_MOE_LORA" in capabilities.expert_lora_unavailable_reason()
    with pytest.raises(capabilities.ExpertLoRAUnavailableError, match="acme-experts.*switched off"):
        capabilities.require_expert_lora("acme-experts")
    # vLLM on CUDA applies expert LoRA itself.
    assert capabilities.engine_applies_expert_lora(platform="cuda")


def test_capability_off_when_vllm_would_not_load_the_plugin(monkeypatch):
    monkeypatch.delenv("LORAPLEX_MOE_LORA", raising=False)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert not capabilities.engine_applies_expert_lora()
    monkeypatch.setenv("VLLM_PLUGINS", f"lora_filesystem_resolver,{capabilities.PLUGIN_NAME}")
    assert capabilities.engine_applies_expert_lora()


def test_install_refuses_other_vllm_versions(monkeypatch):
    import vllm

    from kernels.vllm import cpu as vllm_cpu
    from kernels.vllm.patching import Patches
    from kernels.vllm.versions import UnsupportedVLLMError

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(vllm_cpu, "PATCHES", Patches("a process where nothing is installed yet"))
    with pytest.raises(UnsupportedVLLMError, match="0.33.0"):
        vllm_cpu.install()
    assert not vllm_cpu.PATCHES.active
    assert "0.33.0" in capabilities.expert_lora_unavailable_reason(platform="cpu")


def test_oracle_wrapper_selects_lora_capable_cpu_experts():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    from kernels.vllm.cpu.experts import choose_lora_experts_cls
    from kernels.vllm.cpu.oracle import make_cpu_oracle

    seen = []

    def original(config):
        seen.append(config.is_lora_enabled)
        return "CPU", CPUUnquantizedExperts

    oracle = make_cpu_oracle(original, choose_lora_experts_cls)
    config = SimpleNamespace(
        is_lora_enabled=True, activation="silu", moe_parallel_config=SimpleNamespace(use_ep=False)
    )
    backend, cls = oracle(config)
    assert backend == "CPU" and seen == [False] and config.is_lora_enabled
    assert issubclass(cls, CPUUnquantizedExperts) and cls.supports_lora()
    assert not CPUUnquantizedExperts.supports_lora()
    oracle(SimpleNamespace(is_lora_enabled=False))
    assert seen == [False, False]
    # A layer the CPU path cannot serve keeps the native class (vLLM then refuses expert LoRA at
    # engine start instead of failing on the first request).
    _, cls = oracle(SimpleNamespace(
        is_lora_enabled=True, activation="gelu", moe_parallel_config=SimpleNamespace(use_ep=False)
    ))
    assert cls is CPUUnquantizedExperts


def test_cpu_lora_ops_give_rows_without_adapter_no_lora(request):
    """vLLM-CPU's torch LoRA ops index stacked weights with -1 (= the last slot) for tokens
    without an adapter; after the patch those rows get no LoRA contribution."""
    from vllm.lora.ops.torch_ops import lora_ops

    from kernels.vllm.cpu.punica import patch_cpu_lora_ops
    from kernels.vllm.patching import Patches

    patches = Patches("test")
    patch_cpu_lora_ops(patches)
    request.addfinalizer(patches.undo)
    L, r, n_in, n_out, T = 3, 4, 16, 8, 6
    a = torch.randn(L, 1, r, n_in)
    b = torch.randn(L, 1, n_out, r)
    x = torch.randn(T, n_in)
    idx = torch.tensor([0, -1, 2, -1, 1, 2])
    mid = torch.zeros(T, r)
    # prefill form (one "sequence" per token), then the decode form over the same rows
    lora_ops.sgmv_shrink(x, a, mid, torch.arange(T), torch.ones(T, dtype=torch.long), idx, T, 1, T, 1.0)
    assert torch.equal(mid[1], torch.zeros(r)) and mid[0].abs().sum() > 0
    lora_ops.bgmv_shrink(x, a, mid, idx, 1.0)
    y = torch.ones(T, n_out)
    lora_ops.bgmv_expand(mid, b, y, idx, True)
    z = torch.ones(T, 2 * n_out)
    lora_ops.bgmv_expand_slice(mid, b, z, idx, n_out, n_out, True)
    for t in range(T):
        if idx[t] < 0:
            assert torch.equal(mid[t], torch.zeros(r)) and torch.equal(y[t], torch.ones(n_out))
        else:
            expected = b[idx[t], 0] @ (a[idx[t], 0] @ x[t])
            torch.testing.assert_close(y[t], 1 + expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(z[t, n_out:], 1 + expected, atol=1e-5, rtol=1e-5)


def test_experts_class_applies_vllm_stacked_lora_like_the_reference(seed):
    """The experts subclass reads vLLM's LoRA context (gate/up slices, slot mapping, enabled flags)
    and matches the reference; tokens without expert LoRA go through the native apply."""
    from kernels.vllm.cpu.experts import lora_experts_class

    T, H, I, E, K, L, r = 19, 32, 16, 6, 2, 3, 8
    p = random_moe_lora_problem(T, H, I, E, K, L, r, slots_without_experts=(2,), no_adapter_fraction=0.3, seed=seed)
    lora = p["lora"]
    native_rows = []

    class FakeNative:
        def process_weights_after_loading(self, layer):
            layer.w13_weight = torch.zeros(1)  # "prepacked": unusable by anyone else

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *rest):
            native_rows.append(hidden_states.shape[0])
            output.copy_(moe_lora_reference(
                hidden_states, topk_ids, topk_weights, torch.full((hidden_states.shape[0],), -1),
                p["w13"], p["w2"], None,
            ))

    experts = lora_experts_class(FakeNative)()
    experts.process_weights_after_loading(SimpleNamespace(w13_weight=p["w13"], w2_weight=p["w2"]))
    gate_b, up_b = lora.w13_b[:, :, :I].clone(), lora.w13_b[:, :, I:].clone()
    s = lora.scaling[:, None, None, None]
    enabled = torch.tensor([1, 1, 0, 0], dtype=torch.int32)  # max_loras + 1 entries; slot 2 off
    experts.set_lora_context(SimpleNamespace(
        w13_lora_a_stacked=(lora.w13_a, lora.w13_a), w13_lora_b_stacked=(gate_b * s, up_b * s),
        w2_lora_a_stacked=(lora.w2_a,), w2_lora_b_stacked=(lora.w2_b * s,),
        adapter_enabled=enabled, max_loras=L, local_token_lora_mapping=None, fully_sharded=False, tp_size=1,
        punica_wrapper=SimpleNamespace(token_lora_indices=p["token_lora"].long()),
    ))
    out = torch.empty(T, H)
    experts.apply(out, p["x"], None, None, p["topk_weights"], p["topk_ids"], "silu", E, None,
                  None, None, None, None, None, False)
    expected = moe_lora_reference(**p, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected.double(), atol=2e-5, rtol=1e-4)
    with_lora = ((p["token_lora"] == 0) | (p["token_lora"] == 1)).sum().item()
    assert 0 < with_lora < T and native_rows == [T - with_lora]


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, embedded_model_dir, demo_adapter_sources) -> dict:
    """name → adapter dir; ``experts-3d`` is PEFT's fused layout, served after conversion."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("expert-lora-adapters")
    experts_3d = demo_adapter_sources["acme-experts"]
    served_3d = root / "experts-3d-as-2d"
    convert_adapter_dir(experts_3d, served_3d)
    dropped = root / "experts-dropped"
    convert_adapter_dir(experts_3d, dropped)
    tensors = load_file(str(dropped / ADAPTER_WEIGHTS))
    save_file({k: v for k, v in tensors.items() if ".experts." not in k}, str(dropped / ADAPTER_WEIGHTS))
    return {
        "attention": demo_adapter_sources["acme-support"],
        "experts-3d": experts_3d,
        "experts-3d-served": served_3d,
        "experts-dropped": dropped,
        "per-expert-2d": write_per_expert_adapter(embedded_model_dir, root / "per-expert-2d", rank=8, seed=5),
    }


@pytest.fixture(scope="module")
def llm(embedded_model_dir):
    from vllm import LLM

    engine = LLM(
        model=str(embedded_model_dir), dtype="float32", enable_lora=True, max_lora_rank=16,
        max_loras=4, max_cpu_loras=4, max_model_len=512, seed=0,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def served(llm, adapters, embedded_model_dir) -> dict[str, list[list[int]]]:
    """Greedy token ids per (adapter name or "base") for each prompt, all in one mixed batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    names = ["base", "attention", "experts-3d-served", "experts-dropped", "per-expert-2d"]
    requests = {n: LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(names) if n != "base"}
    prompts, loras = [], []
    for text in PROMPTS:
        for n in names:
            prompts.append(TokensPrompt(prompt_token_ids=ref.prompt_ids(embedded_model_dir, text)))
            loras.append(requests.get(n))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), lora_request=loras)
    result: dict[str, list[list[int]]] = {n: [] for n in names}
    for i, out in enumerate(outs):
        result[names[i % len(names)]].append(list(out.outputs[0].token_ids))
    return result


def _peft_greedy(model_dir, adapter_dir) -> list[list[int]]:
    return [ref.greedy(model_dir, adapter_dir, ref.prompt_ids(model_dir, t), MAX_NEW_TOKENS) for t in PROMPTS]


def test_requests_without_adapter_unchanged_by_lora(served, embedded_model_dir):
    assert served["base"] == _peft_greedy(embedded_model_dir, None)


def test_attention_adapter_matches_peft(served, adapters, embedded_model_dir):
    assert served["attention"] == _peft_greedy(embedded_model_dir, adapters["attention"])
    assert served["attention"] != served["base"]  # the adapter shows in the output


def test_fused_3d_expert_adapter_matches_peft(served, adapters, embedded_model_dir):
    expected = _peft_greedy(embedded_model_dir, adapters["experts-3d"])
    assert served["experts-3d-served"] == expected
    # The expert weights matter: without them the same adapter decodes differently.
    assert served["experts-dropped"] != expected
    assert served["experts-dropped"] == _peft_greedy(embedded_model_dir, adapters["experts-dropped"])


def test_per_expert_2d_adapter_matches_merged_transformers(served, adapters, embedded_model_dir):
    model = merged_model(embedded_model_dir, adapters["per-expert-2d"])
    eos = ref.tokenizer(str(embedded_model_dir)).eos_token_id
    expected = [greedy_with(model, ref.prompt_ids(embedded_model_dir, t), MAX_NEW_TOKENS, eos) for t in PROMPTS]
    assert served["per-expert-2d"] == expected
    assert served["per-expert-2d"] != served["base"]


def test_single_request_equals_its_result_in_the_mixed_batch(llm, adapters, served, embedded_model_dir):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ref.prompt_ids(embedded_model_dir, PROMPTS[1]))],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
        lora_request=LoRARequest("per-expert-2d", 4, str(adapters["per-expert-2d"])),
    )
    assert list(out[0].outputs[0].token_ids) == served["per-expert-2d"][1]
