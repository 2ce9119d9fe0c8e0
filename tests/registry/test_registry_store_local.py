"""Local-directory store: publish / get / list / delete, atomic versions, hostile adapters refused."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters_registry.errors import AdapterConflict, AdapterInvalid, AdapterNotFound
from adapters_registry.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    BaseModelInfo,
)
from adapters_registry.stores import open_store
from adapters_registry.validation import ValidationLimits
from adapters_registry.verify import sha256_file
from benchmarks.synthetic_adapters import synthetic_adapter
from tests.helpers.assets import tiny_assets
from tests.helpers.change_marker import assert_marker_moves_on_every_change


@pytest.fixture(scope="module")
def assets():
    return tiny_assets()


@pytest.fixture(scope="module")
def base(assets) -> BaseModelInfo:
    return BaseModelInfo.from_model_dir(assets["base"])


@pytest.fixture
def store(tmp_path):
    return open_store((tmp_path / "store").as_uri())


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_base_model_info_from_tiny_qwen3_moe(base):
    assert base.architecture == "Qwen3MoeForCausalLM"
    assert (base.hidden_size, base.num_experts, base.moe_intermediate_size, base.num_layers) == (128, 8, 64, 2)
    assert base.module_shapes()["q_proj"] == (128, 128) and base.module_shapes()["k_proj"] == (128, 64)
    assert base.expert_shapes()["gate_up_proj"] == (128, 128) and base.expert_shapes()["down_proj"] == (64, 128)


def test_publish_get_list_versions(store, assets, base):
    m1 = store.publish(assets["attn"], "acme-attn", "acme", base)
    assert (m1.version, m1.layout, m1.has_expert_lora, m1.rank) == (1, "none", False, 8)
    assert sorted(f.name for f in m1.files) == [CONFIG_NAME, WEIGHTS_NAME]
    src_sha, _ = sha256_file(assets["attn"] / WEIGHTS_NAME)
    assert m1.file(WEIGHTS_NAME).sha256 == src_sha  # attention-only: published byte for byte
    m2 = store.publish(assets["attn"], "acme-attn", "acme", base)
    assert m2.version == 2
    assert store.get("acme-attn") == m2 and store.get("acme-attn", 1) == m1
    assert [m.lora_name for m in store.list()] == ["acme-attn@v2"]
    assert store.versions("acme-attn") == [1, 2]
    on_disk = store.root / "acme-attn" / "2"
    assert sorted(p.name for p in on_disk.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, MANIFEST_NAME]
    with pytest.raises(AdapterNotFound):
        store.get("acme-attn", 7)
    with pytest.raises(AdapterNotFound):
        store.get("nobody")


def test_change_marker_moves_after_every_publish_and_delete(store, assets, base):
    assert_marker_moves_on_every_change(store, assets["attn"], base)


def test_other_tenant_cannot_take_an_id(store, assets, base):
    store.publish(assets["attn"], "shared-name", "acme", base)
    with pytest.raises(AdapterConflict, match="belongs to tenant 'acme'"):
        store.publish(assets["attn"], "shared-name", "globex", base)


def test_delete_then_repush_never_reuses_a_version(store, assets, base):
    store.publish(assets["attn"], "a1", "acme", base)
    store.publish(assets["attn"], "a1", "acme", base)
    assert store.delete("a1") == [1, 2]
    with pytest.raises(AdapterNotFound):
        store.get("a1")
    assert store.list() == []
    assert store.publish(assets["attn"], "a1", "acme", base).version == 3
    with pytest.raises(AdapterNotFound):
        store.delete("never-was")


def test_incomplete_version_is_invisible(store, assets, base):
    store.publish(assets["attn"], "a1", "acme", base)
    half = store.root / "a1" / "2"
    half.mkdir()
    shutil.copy(assets["attn"] / CONFIG_NAME, half / CONFIG_NAME)  # no manifest: still being written
    assert store.get("a1").version == 1
    assert store.versions("a1") == [1]


def test_download_verifies(store, assets, base, tmp_path):
    m = store.publish(assets["attn"], "a1", "acme", base)
    out = store.download(m, tmp_path / "dl")
    assert sha256_file(out / WEIGHTS_NAME) == (m.file(WEIGHTS_NAME).sha256, m.file(WEIGHTS_NAME).size)
    f = store.root / "a1" / "1" / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(AdapterInvalid, match="sha256 mismatch"):
        store.download(m, tmp_path / "dl2")
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(AdapterInvalid, match="truncated"):
        store.download(m, tmp_path / "dl3")


# ---- hostile adapters -------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(str(d / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(d / WEIGHTS_NAME), metadata={"format": "pt"})


def _edit_config(d: Path, **kw) -> None:
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg.update(kw)
    (d / CONFIG_NAME).write_text(json.dumps(cfg))


def _first_key(t, suffix="q_proj.lora_A.weight"):
    return next(k for k in t if k.endswith(suffix))


def _pickle_bin(d: Path) -> None:
    (d / WEIGHTS_NAME).unlink()
    torch.save({"x": torch.zeros(2)}, d / "adapter_model.bin")


def _pickle_disguised(d: Path) -> None:
    torch.save({"x": torch.zeros(2)}, d / WEIGHTS_NAME)  # pickle bytes under the safetensors name


def _nan(d: Path) -> None:
    _edit_tensors(d, lambda t: t[_first_key(t)].__setitem__((0, 0), float("nan")))


def _inf(d: Path) -> None:
    _edit_tensors(d, lambda t: t[_first_key(t, "o_proj.lora_B.weight")].__setitem__((1, 1), float("inf")))


def _wrong_shape(d: Path) -> None:
    def f(t):
        k = _first_key(t)
        t[k] = torch.zeros(t[k].shape[0], 96)

    _edit_tensors(d, f)


def _unknown_module(d: Path) -> None:
    def f(t):
        k = _first_key(t)
        t[k.replace("q_proj", "qq_proj")] = t.pop(k)
        kb = k.replace("lora_A", "lora_B")
        t[kb.replace("q_proj", "qq_proj")] = t.pop(kb)

    _edit_tensors(d, f)


def _missing_b(d: Path) -> None:
    _edit_tensors(d, lambda t: t.pop(_first_key(t, "q_proj.lora_B.weight")))


def _layer_out_of_range(d: Path) -> None:
    def f(t):
        for k in [k for k in t if ".layers.1." in k]:
            t[k.replace(".layers.1.", ".layers.7.")] = t.pop(k)

    _edit_tensors(d, f)


def _int_dtype(d: Path) -> None:
    def f(t):
        k = _first_key(t)
        t[k] = t[k].to(torch.int32)

    _edit_tensors(d, f)


def _truncated(d: Path) -> None:
    data = (d / WEIGHTS_NAME).read_bytes()
    (d / WEIGHTS_NAME).write_bytes(data[:-100])


def _huge_header(d: Path) -> None:
    (d / WEIGHTS_NAME).write_bytes(struct.pack("<Q", 2**40) + b"{}")


def _dora(d: Path) -> None:
    _edit_config(d, use_dora=True)


def _not_lora(d: Path) -> None:
    _edit_config(d, peft_type="IA3")


def _modules_to_save(d: Path) -> None:
    _edit_config(d, modules_to_save=["lm_head"])


HOSTILE = {
    "pickle .bin": (_pickle_bin, "pickle"),
    "pickle bytes named .safetensors": (_pickle_disguised, "not a safetensors file"),
    "NaN weight": (_nan, "NaN or Inf"),
    "Inf weight": (_inf, "NaN or Inf"),
    "wrong shape": (_wrong_shape, "do not fit the base module"),
    "unknown module": (_unknown_module, "not a LoRA-targetable module"),
    "lora_A without lora_B": (_missing_b, "not both lora_A and lora_B"),
    "layer out of range": (_layer_out_of_range, "layer 7 does not exist"),
    "integer dtype": (_int_dtype, "dtype I32"),
    "truncated file": (_truncated, "truncated"),
    "absurd header length": (_huge_header, "not a safetensors file"),
    "DoRA": (_dora, "use_dora"),
    "not LoRA": (_not_lora, "only LORA"),
    "modules_to_save": (_modules_to_save, "modules_to_save"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_adapter_refused_and_store_unchanged(case, store, assets, base, tmp_path):
    store.publish(assets["attn"], "good", "acme", base)
    before = tree(store.root)
    mutate, message = HOSTILE[case]
    bad = _copy(assets["attn"], tmp_path / "bad")
    mutate(bad)
    with pytest.raises(AdapterInvalid, match=message):
        store.publish(bad, "evil", "acme", base)
    with pytest.raises(AdapterInvalid):
        store.publish(bad, "good", "acme", base)  # not even as a new version of a good adapter
    assert tree(store.root) == before


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", "..", ".hidden", "", "x" * 200, "a..b", "a b", "a@v1", "é"])
def test_unsafe_ids_refused(bad_id, store, assets, base):
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.publish(assets["attn"], bad_id, "acme", base)
    with pytest.raises(AdapterInvalid):
        store.get(bad_id)
    assert tree(store.root) == {}


def test_unsafe_tenant_refused(store, assets, base):
    with pytest.raises(AdapterInvalid, match="invalid tenant"):
        store.publish(assets["attn"], "ok", "../root", base)


def test_rank_above_engine_limit_refused(store, assets, base, tmp_path):
    with pytest.raises(AdapterInvalid, match="rank 8 exceeds the engine's max_lora_rank 4"):
        store.publish(assets["attn"], "a1", "acme", base, max_lora_rank=4)
    big = synthetic_adapter(tmp_path / "r128", base, r=128)
    with pytest.raises(AdapterInvalid, match="exceeds the engine's max_lora_rank 64"):
        store.publish(big, "a1", "acme", base)
    assert store.list() == []


def test_oversize_refused(store, assets, base):
    size = sum(p.stat().st_size for p in assets["attn"].iterdir() if p.is_file())
    with pytest.raises(AdapterInvalid, match="over the limit"):
        store.publish(assets["attn"], "a1", "acme", base, limits=ValidationLimits(max_total_bytes=size // 2))
    assert store.list() == []


def test_adapter_for_another_base_refused(store, assets, tmp_path):
    other = BaseModelInfo.from_config(
        {"architectures": ["X"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    )
    with pytest.raises(AdapterInvalid, match="another base model"):
        store.publish(assets["attn"], "a1", "acme", other)


def test_publish_reports_upload_progress_in_bytes(store, assets, base):
    """The bytes reported add up to the published (normalised) files, against their total."""
    calls = []
    m = store.publish(assets["experts3d"], "acme-progress", "acme", base, progress=lambda n, total: calls.append((n, total)))
    assert calls and {total for _, total in calls} == {m.total_bytes}
    assert sum(n for n, _ in calls) == m.total_bytes
