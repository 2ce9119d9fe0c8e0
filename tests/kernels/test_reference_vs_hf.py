"""The MoE-LoRA reference (and the CPU path) against transformers + PEFT on the embedded model's
MoE layers, with the demo attention+experts adapter (PEFT's fused 3-D layout)."""

from __future__ import annotations

import pytest
import torch

from adapters_registry.peft_layouts import fused_to_per_expert
from kernels.cpu.moe_lora import moe_lora_cpu
from kernels.moe_math import MoELoRAWeights
from kernels.reference import moe_lora_reference
from tests.helpers.expert_lora import (
    per_expert_factors,
    read_adapter,
    reference_from_fused,
    scaling_of,
)


@pytest.fixture(scope="module")
def hf_models(embedded_model_dir, demo_adapter_sources):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir), dtype=torch.float32).eval()
    base_weights = {
        layer: (
            base.model.layers[layer].mlp.experts.gate_up_proj.detach().clone(),
            base.model.layers[layer].mlp.experts.down_proj.detach().clone(),
        )
        for layer in range(base.config.num_hidden_layers)
    }
    adapter_dir = demo_adapter_sources["acme-experts"]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(embedded_model_dir), dtype=torch.float32), str(adapter_dir)
    ).eval()
    return base, base_weights, peft_model, read_adapter(adapter_dir)


def _peft_block(peft_model, layer):
    return peft_model.base_model.model.model.layers[layer].mlp


def _route(block, x):
    _, weights, ids = block.gate(x)
    return weights, ids


@pytest.mark.parametrize("layer", [0, 1])
def test_reference_matches_peft_moe_block(hf_models, layer):
    base, base_weights, peft_model, (tensors, config) = hf_models
    block = _peft_block(peft_model, layer)
    x = torch.randn(23, base.config.hidden_size)
    with torch.no_grad():
        y_peft = block(x[None])[0]
        weights, ids = _route(block, x)
        y_base = base.model.layers[layer].mlp(x[None])[0]
    w13, w2 = base_weights[layer]
    lora = reference_from_fused(tensors, config, layer)
    token_lora = torch.zeros(x.shape[0], dtype=torch.int32)
    args = dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2, lora=lora)
    y_ref = moe_lora_reference(**args, token_lora=token_lora, compute_dtype=torch.float64)
    assert (y_peft - y_base).abs().max() > 1e-2  # the adapter matters in this layer
    torch.testing.assert_close(y_ref, y_peft, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(moe_lora_cpu(**args, token_lora=token_lora), y_peft, atol=2e-5, rtol=1e-4)
    # Tokens without an adapter get the base block.
    none = torch.full_like(token_lora, -1)
    torch.testing.assert_close(moe_lora_reference(**args, token_lora=none), y_base, atol=2e-5, rtol=1e-4)


def test_reference_with_converted_per_expert_weights_matches_peft(hf_models):
    """The 2-D layout (after conversion), folded with ``from_gate_up``, gives PEFT's output too."""
    base, base_weights, peft_model, (tensors, config) = hf_models
    layer = 1
    tensors_2d, config_2d = fused_to_per_expert(tensors, config)
    f = per_expert_factors(tensors_2d, layer)
    E = base.config.num_experts

    def stack(module, ab):
        return torch.stack([f[(e, module)][ab] for e in range(E)])[None]

    w13_a, w13_b = MoELoRAWeights.from_gate_up(
        stack("gate_proj", 0), stack("gate_proj", 1), stack("up_proj", 0), stack("up_proj", 1)
    )
    lora = MoELoRAWeights(
        w13_a=w13_a, w13_b=w13_b, w2_a=stack("down_proj", 0), w2_b=stack("down_proj", 1),
        scaling=torch.tensor([scaling_of(config_2d)]), has_experts=torch.tensor([True]),
    )
    block = _peft_block(peft_model, layer)
    x = torch.randn(11, base.config.hidden_size)
    with torch.no_grad():
        y_peft = block(x[None])[0]
        weights, ids = _route(block, x)
    w13, w2 = base_weights[layer]
    y = moe_lora_cpu(x, ids, weights, torch.zeros(11, dtype=torch.int32), w13, w2, lora)
    torch.testing.assert_close(y, y_peft, atol=2e-5, rtol=1e-4)
