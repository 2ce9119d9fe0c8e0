"""Tiny base models and PEFT adapters for tests (no downloads).

``tiny_base_dir`` writes the embedded tiny Qwen3-MoE's config (or a whole model); ``peft_adapter``
trains nothing but saves a real PEFT adapter with random (non-zero) LoRA weights on that model;
``tiny_assets`` builds one base and two adapters once per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_base_dir(path: str | Path, with_weights: bool = False, seed: int = 0) -> Path:
    """A HF folder of the embedded tiny Qwen3-MoE (``app.embedded.model``'s config; config only
    unless ``with_weights``, then random weights of ``seed``)."""
    from app.embedded.model import tiny_qwen3_moe_config

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_qwen3_moe_config()
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    if with_weights:
        import torch
        from transformers import Qwen3MoeForCausalLM

        torch.manual_seed(seed)
        Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out


def peft_adapter(
    path: str | Path,
    base_dir: str | Path,
    kind: Literal["attn", "experts3d"] = "attn",
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
):
    """Save a PEFT LoRA adapter with random weights; returns the PEFT model (for merging checks)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(base_dir))
    kw: dict = {"target_modules": list(ATTN)}
    if kind == "experts3d":
        kw["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, **kw))
    peft_model.save_pretrained(str(path))
    return peft_model


_ASSETS: dict[str, Path] | None = None


def tiny_assets() -> dict[str, Path]:
    """Build once per process (in a temp folder removed at exit): ``base`` (config only), ``attn``
    and ``experts3d`` (PEFT adapters on the tiny Qwen3-MoE)."""
    global _ASSETS
    if _ASSETS is None:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="loraplex-registry-assets-"))
        atexit.register(shutil.rmtree, root, True)
        base = tiny_base_dir(root / "base")
        peft_adapter(root / "attn", base, "attn", seed=1)
        peft_adapter(root / "experts3d", base, "experts3d", seed=2)
        _ASSETS = {"root": root, "base": base, "attn": root / "attn", "experts3d": root / "experts3d"}
    return _ASSETS


def publish_synthetic(store, base, tmp_path: Path, n: int, r: int = 4, first_seed: int = 0) -> list:
    """``n`` synthetic rank-``r`` adapters ``ad0`` ... published to ``store`` for tenant acme
    (seeds ``first_seed`` + i); their manifests."""
    from benchmarks.synthetic_adapters import synthetic_adapter

    return [store.publish(synthetic_adapter(tmp_path / f"src{i}", base, r=r, seed=first_seed + i),
                          f"ad{i}", "acme", base) for i in range(n)]
