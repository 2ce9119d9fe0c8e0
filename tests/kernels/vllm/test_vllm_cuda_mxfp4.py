"""The MXFP4 backend choice under LoRA (``kernels.vllm.cuda.mxfp4``): when it takes vLLM's unfused
Triton backend and when it leaves vLLM's own choice. The device checks of that backend are vLLM's
(stubbed here); that it is picked on an H200 is in the engine log of the end-to-end runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle

from kernels.vllm.cuda import mxfp4 as vllm_cuda_mxfp4
from kernels.vllm.patching import Patches


def moe_config(lora=True, backend="auto", batched=False):
    return SimpleNamespace(is_lora_enabled=lora, moe_backend=backend,
                           moe_parallel_config=SimpleNamespace(
                               use_batched_activation_format=batched))


@pytest.fixture
def vllm_side(monkeypatch):
    """vLLM's checks of the unfused backend (recorded, answer set per test) and its config."""
    state = {"supported": True, "calls": [], "vllm_config": None}

    def return_or_raise(backend, config, weight_key, activation_key, activation_format):
        state["calls"].append((backend, activation_key, activation_format))
        if not state["supported"]:
            raise ValueError("not supported here")
        return backend, "UnfusedExperts"

    monkeypatch.setattr(oracle, "_return_or_raise", return_or_raise)
    monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none",
                        lambda: state["vllm_config"])
    return state


def test_lora_on_auto_backend_takes_the_unfused_triton_backend(vllm_side):
    got = vllm_cuda_mxfp4._lora_choice(moe_config(), None)
    assert got == (oracle.Mxfp4MoeBackend.TRITON_UNFUSED, "UnfusedExperts")
    (backend, act_key, fmt), = vllm_side["calls"]
    assert act_key is None and fmt.name == "Standard"


@pytest.mark.parametrize("config,activation_key,vllm_config", [
    (moe_config(lora=False), None, None),                    # no LoRA: vLLM's fused choice
    (moe_config(backend="marlin"), None, None),              # the operator chose a backend
    (moe_config(batched=True), None, None),                  # batched activations (EP)
    (moe_config(), "fp8", None),                             # activation quantisation asked
    (moe_config(), None, SimpleNamespace(speculative_config=object())),  # MTP bug in vLLM
])
def test_other_cases_keep_vllms_choice(vllm_side, config, activation_key, vllm_config):
    vllm_side["vllm_config"] = vllm_config
    assert vllm_cuda_mxfp4._lora_choice(config, activation_key) is None
    assert vllm_side["calls"] == []


def test_unsupported_device_keeps_vllms_choice(vllm_side):
    vllm_side["supported"] = False
    assert vllm_cuda_mxfp4._lora_choice(moe_config(), None) is None


def test_install_wraps_the_name_the_mxfp4_method_calls(vllm_side, monkeypatch):
    from vllm.model_executor.layers.quantization import mxfp4

    original = mxfp4.select_mxfp4_moe_backend
    monkeypatch.setattr(mxfp4, "select_mxfp4_moe_backend",
                        lambda config, activation_key=None: ("vllm's own", config.moe_backend))
    patches = Patches("test")
    vllm_cuda_mxfp4.install_backend_choice(patches)
    try:
        pick = mxfp4.select_mxfp4_moe_backend
        assert pick(moe_config())[0] is oracle.Mxfp4MoeBackend.TRITON_UNFUSED
        assert pick(moe_config(lora=False)) == ("vllm's own", "auto")
    finally:
        patches.undo()
    assert mxfp4.select_mxfp4_moe_backend(moe_config())[0] == "vllm's own"
    monkeypatch.setattr(mxfp4, "select_mxfp4_moe_backend", original)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_choosing_the_unfused_backend_compiles_the_routing_kernel(vllm_side):
    """The layer's routing-inputs kernel compiles while the model is built: a step's call
    (any number of rows) then finds its variant."""
    import torch

    from kernels.mxfp4 import routing as mxfp4_routing

    config = moe_config()
    config.device, config.experts_per_token, config.num_local_experts = "cuda", 4, 32
    vllm_cuda_mxfp4.unfused_under_lora(lambda c, a=None: pytest.fail("vLLM's own choice was taken"))(config)
    variants = dict(mxfp4_routing._ROUTING_INPUTS.variants)
    assert variants
    ids = (torch.arange(1200, dtype=torch.int32, device="cuda") % 32).view(300, 4)
    mxfp4_routing.routing_inputs(ids, torch.rand(300, 4, device="cuda"), 32)
    assert mxfp4_routing._ROUTING_INPUTS.variants == variants
