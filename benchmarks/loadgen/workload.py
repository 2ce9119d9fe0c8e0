"""The workload of a phase: seeded prompts, the model of each request, request bodies, and the
vocabulary prompts are drawn from."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen.spec import LoadSpec, TargetSpec, zipf_s

CHAT_WORDS = ("route", "expert", "token", "adapter", "tenant", "model", "batch", "prompt", "cache", "layer")


def prompt_ids(spec: LoadSpec, phase: str, index: int) -> list[int]:
    """Seeded random token ids of request ``index`` of ``phase``, special ids left out."""
    rng = random.Random(f"{spec.seed}/{spec.concurrency}/{phase}/{index}")
    excluded = set(spec.exclude_token_ids)
    ids: list[int] = []
    while len(ids) < spec.input_len:
        tok = rng.randrange(spec.vocab_size)
        if tok not in excluded:
            ids.append(tok)
    return ids


def model_sequence(spec: LoadSpec, phase: str, n: int, popularity: str) -> list[str | None]:
    """The adapter id (None: base) of each of ``n`` requests."""
    models = spec.models()
    if popularity == "round-robin":
        return [models[i % len(models)] for i in range(n)]
    rng = random.Random(f"{spec.seed}/{spec.concurrency}/{phase}/models")
    s = zipf_s(popularity)
    weights = [1.0] * len(models) if s is None else [1.0 / (i + 1) ** s for i in range(len(models))]
    return rng.choices(models, weights=weights, k=n)


def request_body(spec: LoadSpec, model: str, phase: str, index: int) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.output_len, "min_tokens": spec.output_len, "ignore_eos": True,
        "temperature": spec.temperature, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True} if spec.continuous_usage
        else {"include_usage": True},
    }
    ids = prompt_ids(spec, phase, index)
    if spec.endpoint == "completions":
        body["prompt"] = ids
    else:
        body["messages"] = [{"role": "user", "content": " ".join(CHAT_WORDS[t % len(CHAT_WORDS)] for t in ids)}]
    return body


def model_vocab(model_dir: Path) -> tuple[int, list[int]]:
    """Vocabulary size and special token ids of a HF model folder (config.json, tokenizer.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"no vocab_size in {model_dir / 'config.json'}")
    special: set[int] = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(name)
        special.update(ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else [])
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        special.update(t["id"] for t in json.loads(tok.read_text()).get("added_tokens", []) if t.get("special"))
    return int(vocab), sorted(i for i in special if i < vocab)


def server_model_dir(target: TargetSpec) -> Path | None:
    """The local folder a vLLM server reports as its base model's ``root`` in /v1/models, if any."""
    key = target.key_for(None, 0) if target.base_model else target.api_key
    try:
        r = httpx.get(target.base_url + "/v1/models", timeout=30,
                      headers={"Authorization": f"Bearer {key}"} if key else {})
        r.raise_for_status()
        for m in r.json().get("data", []):
            root = m.get("root")
            if root and not m.get("parent") and (Path(root) / "config.json").exists():
                return Path(root)
    except (httpx.HTTPError, ValueError):
        return None
    return None
