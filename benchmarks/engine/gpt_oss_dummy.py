"""A GPT-OSS-20B-shaped model with random weights that routes like a trained one, for GPU runs.

No checkpoint is downloaded: ``write_model_dir`` writes the public architecture's ``config.json``
(bf16 experts, or MXFP4 experts as released) and vLLM loads it with ``load_format="dummy"``.

vLLM's dummy loader draws every float parameter from U(-1e-3, 1e-3) and leaves integer ones
(MXFP4 blocks and scales) as allocated. Then RMSNorm weights of ~1e-3 shrink the router input,
the router bias decides alone and every token picks the same experts: a decode step reads 4 of
32 experts instead of ~28, which flatters the base model. ``use_balanced_dummy_weights`` patches
the loader (in this process; the engine must run in-process) so that after the random fill:

- norms are 1, routers ``N(0, 1/hidden)`` with zero bias, other biases zero, the token
  embedding ``N(0, 1)`` (a token-specific residual, so each layer routes it independently);
- the LM head is ``N(0, (head_std)^2 / hidden)``: logits of a few units, so greedy decoding
  and log-probabilities are informative;
- MXFP4 scales (uint8 E8M0) are 2^-9 and the packed FP4 blocks uniform random bytes (FP4 has
  no NaN), before vLLM repacks them for its kernel.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from benchmarks.shapes import GPT_OSS_20B_CONFIG

# the release's quantization: experts in MXFP4; attention, router, embeddings, head in bf16
MXFP4_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}


BALANCED_ENV = "LORAPLEX_BALANCED_DUMMY"
# engine settings every GPU run on this model shares (random weights, bf16 activations)
ENGINE_ARGS = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=64,
                   max_num_batched_tokens=8192, gpu_memory_utilization=0.85)


def write_model_dir(root: str | Path, mxfp4: bool) -> Path:
    """``<root>/gpt-oss-20b-shape[-mxfp4]/config.json``; returns the folder."""
    cfg = dict(GPT_OSS_20B_CONFIG)
    if mxfp4:
        cfg["quantization_config"] = MXFP4_QUANTIZATION
    out = Path(root) / ("gpt-oss-20b-shape-mxfp4" if mxfp4 else "gpt-oss-20b-shape")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_tokenizer(model_dir: str | Path, vocab_size: int | None = None) -> Path:
    """A word-level tokenizer with one token per id (``t0`` ... ``t{vocab-1}``) in ``model_dir``,
    so an OpenAI server can run the random-weight model: prompts as token ids, every generated
    token a non-empty piece of text (no download; the model's vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return model_dir
    size = vocab_size or json.loads((model_dir / "config.json").read_text())["vocab_size"]
    vocab = {f"t{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins pieces with spaces
    eos = f"t{GPT_OSS_20B_CONFIG['eos_token_id']}"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="t0",
                            unk_token="t0").save_pretrained(str(model_dir))
    return model_dir


def register() -> None:
    """vLLM general plugin (entry point registered on a benchmark host only, see
    ``scripts/register_entry_points.py``): balanced dummy weights in every vLLM process that
    has ``LORAPLEX_BALANCED_DUMMY=1``, so servers started as their own processes (``vllm
    serve``, ray.serve.llm, loraplex) route like a real model too."""
    if os.environ.get(BALANCED_ENV, "") == "1":
        use_balanced_dummy_weights()


def write_adapters(root: str | Path, count: int, rank: int, scale: float) -> list[Path]:
    """``count`` PEFT adapters (attention q/k/v/o + the fused 3-D experts, bf16, seeds 0..)."""
    from adapters_registry.manifest import BaseModelInfo
    from benchmarks.synthetic_adapters import synthetic_adapter

    base = BaseModelInfo.from_config(GPT_OSS_20B_CONFIG, name="gpt-oss-20b-shape")
    paths = []
    for i in range(count):
        path = Path(root) / f"gptoss-r{rank}-s{scale:g}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            synthetic_adapter(path, base, r=rank, alpha=2 * rank, experts="3d", dtype="bfloat16",
                              seed=1000 + i, scale=scale)
        paths.append(path)
    return paths


def _rebalance(model, hidden: int, head_std: float) -> dict[str, int]:
    import torch

    gen: dict = {}

    def g(dev):
        return gen.setdefault(dev, torch.Generator(device=dev).manual_seed(4321))

    counts: dict[str, int] = {}

    def bump(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    with torch.no_grad():
        for name, p in model.named_parameters():
            if torch.is_floating_point(p):
                if name.endswith("norm.weight"):
                    p.fill_(1.0), bump("norm")
                elif name.endswith("router.weight"):
                    p.normal_(0.0, hidden**-0.5, generator=g(p.device)), bump("router")
                elif name.endswith("bias"):
                    p.zero_(), bump("bias")
                elif name.endswith("embedding.weight") or name.endswith("embed_tokens.weight"):
                    p.normal_(0.0, 1.0, generator=g(p.device)), bump("embedding")
                elif name.endswith("lm_head.weight"):
                    p.normal_(0.0, head_std * hidden**-0.5, generator=g(p.device)), bump("head")
            elif p.dtype == torch.uint8:
                if name.endswith("scale"):
                    p.fill_(118), bump("mxfp4_scale")
                else:
                    p.random_(0, 256, generator=g(p.device)), bump("mxfp4_blocks")
    return counts


def use_balanced_dummy_weights(head_std: float = 4.0) -> None:
    """Patches vLLM's ``DummyModelLoader.load_weights`` in this process (idempotent)."""
    from vllm.model_executor.model_loader import dummy_loader

    cls = dummy_loader.DummyModelLoader
    if getattr(cls.load_weights, "_loraplex_balanced", False):
        return
    original = cls.load_weights

    def load_weights(self, model, model_config):
        original(self, model, model_config)
        counts = _rebalance(model, model_config.hf_text_config.hidden_size, head_std)
        print(f"balanced dummy weights: {counts}", flush=True)

    load_weights._loraplex_balanced = True
    cls.load_weights = load_weights


def in_process_engine_env() -> None:
    """The engine core and worker in this process (so the patches above and a kernel switch
    reach them); call before importing vLLM's engine."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def lora_engine(model_dir: str | Path, num_adapters: int, rank: int, *, eager: bool,
                max_model_len: int, lora: bool = True, max_lora_rank: int | None = None):
    """vLLM's offline ``LLM`` on the dummy model with LoRA on (``max_loras`` = adapters, LoRA on
    the modules loraplex serves it for as its engines do, no prefix caching, 8192 tokens per
    step; ``lora=False``: the same engine without LoRA, the baseline a served model without
    adapters runs; ``max_lora_rank``: the slots' rank, default the adapters' ``rank``); call
    ``in_process_engine_env`` first."""
    from vllm import LLM

    from app.engine.lora_targets import SERVED_LORA_TARGETS

    lora_args = dict(enable_lora=True, max_loras=num_adapters, max_lora_rank=max_lora_rank or rank,
                     max_cpu_loras=num_adapters, lora_target_modules=list(SERVED_LORA_TARGETS)
                     ) if lora else dict(enable_lora=False)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=eager,
               max_model_len=max_model_len, enable_prefix_caching=False, seed=0, **lora_args,
               **ENGINE_ARGS)


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (no tokenizer needed)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 200000) for _ in range(length)] for _ in range(count)]


def adapter_requests(paths: list[Path], count: int) -> list:
    """``count`` LoRA requests, request i on adapter ``i % len(paths)``."""
    from vllm.lora.request import LoRARequest

    return [LoRARequest(f"a{i % len(paths)}", i % len(paths) + 1, str(paths[i % len(paths)]))
            for i in range(count)]


def add_run_args(ap, *, adapters: int, prompt_len: int) -> None:
    """The options every GPU script on this model takes (``argparse`` parser ``ap``)."""
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (as released)")
    ap.add_argument("--adapters", type=int, default=adapters)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--workdir", default="/tmp/loraplex-gpu")
    ap.add_argument("--json", default=None)
