"""adapters_registry/peft_layouts.py: the fused 3-D → per-expert 2-D conversion is exact (checked by merging)."""

from __future__ import annotations

import json

import pytest
import torch

from adapters_registry.peft_layouts import (
    AdapterLayoutError,
    convert_adapter_dir,
    fused_to_per_expert,
    has_expert_lora,
    is_fused_expert_adapter,
)
from tests.helpers.expert_lora import expert_deltas_from_per_expert, read_adapter


@pytest.fixture(scope="module")
def experts_3d(demo_adapter_sources):
    return demo_adapter_sources["acme-experts"]


def test_conversion_equals_peft_merge(embedded_model_dir, experts_3d, tmp_path):
    """Base + deltas of the converted 2-D adapter == PEFT's own merge of the 3-D adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "2d"
    assert convert_adapter_dir(experts_3d, dst) is True
    tensors, config = read_adapter(dst)
    assert "target_parameters" not in config
    assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
    assert not any(".base_layer." in k for k in tensors)

    base = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir), dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(experts_3d)).merge_and_unload().state_dict()
    E = base.config.num_experts
    for layer in range(base.config.num_hidden_layers):
        d13, d2 = expert_deltas_from_per_expert(tensors, config, layer, E)
        pre = f"model.layers.{layer}.mlp.experts"
        delta_peft_13 = merged[f"{pre}.gate_up_proj"] - base_state[f"{pre}.gate_up_proj"]
        delta_peft_2 = merged[f"{pre}.down_proj"] - base_state[f"{pre}.down_proj"]
        assert delta_peft_13.abs().max() > 1e-3  # the adapter really changes the experts
        torch.testing.assert_close(d13, delta_peft_13, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(d2, delta_peft_2, atol=1e-6, rtol=1e-5)
    # Attention LoRA passes through untouched.
    src_tensors, _ = read_adapter(experts_3d)
    for k, v in src_tensors.items():
        if "self_attn" in k:
            assert torch.equal(tensors[k], v)


def _fake_fused(E=3, r=2, H=6, I=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pre = "base_model.model.model.layers.0.mlp.experts"
    return {
        f"{pre}.base_layer.lora_A.weight": torch.randn(E * r, H, generator=g),
        f"{pre}.base_layer.lora_B.weight": torch.randn(2 * I, r * E, generator=g),
        f"{pre}.lora_A.weight": torch.randn(E * r, I, generator=g),
        f"{pre}.lora_B.weight": torch.randn(H, r * E, generator=g),
    }, {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def test_layout_indices_expert_major_a_rank_major_b():
    tensors, config = _fake_fused()
    out, new_config = fused_to_per_expert(tensors, config)
    pre = "base_model.model.model.layers.0.mlp.experts"
    a = tensors[f"{pre}.base_layer.lora_A.weight"]
    b = tensors[f"{pre}.base_layer.lora_B.weight"]
    E, r, I = 3, 2, 4
    for e in range(E):
        assert torch.equal(out[f"{pre}.{e}.gate_proj.lora_A.weight"], a[e * r:(e + 1) * r])
        for j in range(r):
            assert torch.equal(out[f"{pre}.{e}.gate_proj.lora_B.weight"][:, j], b[:I, j * E + e])
            assert torch.equal(out[f"{pre}.{e}.up_proj.lora_B.weight"][:, j], b[I:, j * E + e])
    assert new_config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]


def test_interleaved_gate_up_rows():
    tensors, config = _fake_fused()
    out, _ = fused_to_per_expert(tensors, config, gate_up_interleaved=True)
    pre = "base_model.model.model.layers.0.mlp.experts"
    b = tensors[f"{pre}.base_layer.lora_B.weight"].reshape(8, 2, 3)
    assert torch.equal(out[f"{pre}.1.gate_proj.lora_B.weight"], b[0::2, :, 1])
    assert torch.equal(out[f"{pre}.1.up_proj.lora_B.weight"], b[1::2, :, 1])


def test_bad_shapes_are_refused():
    tensors, config = _fake_fused()
    pre = "base_model.model.model.layers.0.mlp.experts"
    tensors[f"{pre}.lora_B.weight"] = tensors[f"{pre}.lora_B.weight"][:, :-1]
    with pytest.raises(AdapterLayoutError):
        fused_to_per_expert(tensors, config)


def test_detection(tmp_path):
    _, config = _fake_fused()
    assert is_fused_expert_adapter(config) and has_expert_lora(config)
    attn = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    assert not is_fused_expert_adapter(attn) and not has_expert_lora(attn)
    assert has_expert_lora({"target_modules": ["gate_proj"]}, ["x.mlp.experts.0.gate_proj.lora_A.weight"])
    assert not has_expert_lora({"target_modules": ["q_proj"]}, ["x.self_attn.q_proj.lora_A.weight"])
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "adapter_config.json").write_text(json.dumps(attn))
    assert convert_adapter_dir(tmp_path / "src", tmp_path / "dst") is False
    assert (tmp_path / "dst" / "adapter_config.json").exists()
