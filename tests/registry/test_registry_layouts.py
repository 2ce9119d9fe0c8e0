"""PEFT fused 3-D expert LoRA is normalised to per-expert 2-D exactly (checked against PEFT's merge)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from adapters_registry.manifest import WEIGHTS_NAME, BaseModelInfo
from adapters_registry.stores import open_store
from tests.helpers.assets import tiny_assets


@pytest.fixture(scope="module")
def published_3d(tmp_path_factory):
    assets = tiny_assets()
    base = BaseModelInfo.from_model_dir(assets["base"])
    store = open_store((tmp_path_factory.mktemp("store")).as_uri())
    m = store.publish(assets["experts3d"], "moe", "acme", base)
    out = store.download(m, tmp_path_factory.mktemp("dl"))
    return assets, base, m, load_file(str(out / WEIGHTS_NAME))


def test_manifest_records_layouts(published_3d):
    _, _, m, tensors = published_3d
    assert (m.source_layout, m.layout, m.has_expert_lora) == ("3d", "2d", True)
    assert sorted(m.target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert not any(k.endswith("experts.lora_A.weight") or ".base_layer." in k for k in tensors)
    assert tensors["base_model.model.model.layers.1.mlp.experts.7.up_proj.lora_B.weight"].shape == (64, 8)


def test_2d_deltas_equal_peft_merge(published_3d):
    from peft import PeftModel
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    assets, base, m, t = published_3d
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(assets["base"]))
    before = {k: v.clone() for k, v in model.state_dict().items() if ".mlp.experts." in k}
    merged = PeftModel.from_pretrained(model, str(assets["experts3d"])).merge_and_unload()
    after = merged.state_dict()
    scale = m.lora_alpha / m.rank
    i = base.moe_intermediate_size
    checked = 0
    for layer in range(base.num_layers):
        gu = after[f"model.layers.{layer}.mlp.experts.gate_up_proj"] - before[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        dn = after[f"model.layers.{layer}.mlp.experts.down_proj"] - before[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert gu.abs().max() > 1e-3  # the adapter really changes the experts
        for e in range(base.num_experts):
            p = f"base_model.model.model.layers.{layer}.mlp.experts.{e}"

            def delta(leaf):
                return scale * t[f"{p}.{leaf}.lora_B.weight"] @ t[f"{p}.{leaf}.lora_A.weight"]

            torch.testing.assert_close(delta("gate_proj"), gu[e, :i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(delta("up_proj"), gu[e, i:], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(delta("down_proj"), dn[e], rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == base.num_layers * base.num_experts


def test_as_is_keeps_3d(tmp_path):
    assets = tiny_assets()
    base = BaseModelInfo.from_model_dir(assets["base"])
    store = open_store(tmp_path.as_uri())
    m = store.publish(assets["experts3d"], "moe3d", "acme", base, target_layout="as_is")
    assert (m.source_layout, m.layout) == ("3d", "3d")
