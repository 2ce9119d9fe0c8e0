"""Routing check: how many distinct experts each MoE layer reads in a real decode step.

A vLLM general plugin (``register``; found through a site folder written by ``plugin_site`` and
put on the engine process's ``PYTHONPATH``) that, when ``LPX_ROUTE_LOG`` names a file, wraps
vLLM's ``BaseModelLoader.load_model`` in every vLLM process so that each loaded model gets a
forward hook on every router (modules named ``*.mlp.router``, GPT-OSS, or ``*.mlp.gate``,
Qwen3-MoE). For each forward of at most ``LPX_ROUTE_MAX_TOKENS`` tokens the hooks count, per
layer, the distinct experts of the tokens' top-k router logits, and append one JSON line per
forward (tokens, distinct per layer, most tokens on one expert) to the file, for the first
``LPX_ROUTE_MAX_FORWARDS`` such forwards. Python hooks run only in eager engines
(``enforce_eager``: no compiled graphs, no CUDA graphs), so the check runs its own eager engine.

``summarise`` keeps the forwards of exactly ``decode_tokens`` tokens (one decode step of every
request) and compares them with what tokens routed uniformly at random would read:
``E * (1 - (1 - k/E) ** T)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.gpu_stack_parts.models import RouteCheck
from benchmarks.plugin_sites import plugin_site as write_plugin_site

LOG_ENV, TOKENS_ENV, FORWARDS_ENV = "LPX_ROUTE_LOG", "LPX_ROUTE_MAX_TOKENS", "LPX_ROUTE_MAX_FORWARDS"
PLUGIN_NAME = "loraplex_bench_route_hooks"
ROUTER_SUFFIXES = (".mlp.router", ".mlp.gate")


def plugin_site(dest: Path) -> Path:
    """A folder with this plugin's entry point (group ``vllm.general_plugins``) for ``PYTHONPATH``."""
    return write_plugin_site(dest, PLUGIN_NAME, f"{__name__}:register")


def register() -> None:
    """vLLM plugin hook (idempotent): hooks on the routers of every model loaded in this process."""
    if not os.environ.get(LOG_ENV):
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_lpx_route_hooks", False):
        return
    original = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        install_hooks(model, Path(os.environ[LOG_ENV]), int(os.environ.get(TOKENS_ENV, "256")),
                      int(os.environ.get(FORWARDS_ENV, "64")))
        return model

    load_model._lpx_route_hooks = True
    BaseModelLoader.load_model = load_model


def _top_k(model) -> int:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "experts_per_token", 1))


def install_hooks(model, log: Path, max_tokens: int, max_forwards: int) -> int:
    """Forward hooks on the routers of ``model``; returns how many."""
    import torch

    routers = [m for n, m in model.named_modules() if n.endswith(ROUTER_SUFFIXES)]
    top_k = _top_k(model)
    state = {"layers": {}, "written": 0}

    def hook_for(layer: int):
        def hook(module, inputs, output) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            if not torch.is_tensor(logits) or logits.dim() != 2 or logits.shape[0] > max_tokens:
                return
            if state["written"] >= max_forwards:
                return
            picked = logits.float().topk(top_k, dim=-1).indices.flatten()
            counts = torch.bincount(picked, minlength=logits.shape[1])
            state["layers"][layer] = (int((counts > 0).sum()), int(counts.max()), int(logits.shape[1]))
            if layer == len(routers) - 1:
                rows = [state["layers"].get(i, (-1, -1, -1)) for i in range(len(routers))]
                state["layers"] = {}
                state["written"] += 1
                with open(log, "a") as f:
                    f.write(json.dumps({"tokens": int(logits.shape[0]), "top_k": top_k, "experts": rows[-1][2],
                                        "distinct": [r[0] for r in rows], "max_on_one": [r[1] for r in rows]}) + "\n")
        return hook

    for i, m in enumerate(routers):
        m.register_forward_hook(hook_for(i))
    return len(routers)


def uniform_expectation(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens read when each picks ``top_k`` uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def summarise(log: Path, decode_tokens: int) -> RouteCheck:
    """The decode steps of ``decode_tokens`` tokens in a hook log."""
    rows = []
    if log.exists():
        rows = [r for r in map(json.loads, log.read_text().splitlines()) if r["tokens"] == decode_tokens]
    rows = [r for r in rows if min(r["distinct"]) >= 0]
    if not rows:
        return RouteCheck(decode_tokens=decode_tokens, steps=0,
                          error=f"no forward of {decode_tokens} tokens with every router seen in {log}")
    layers = len(rows[0]["distinct"])
    per_layer = [sum(r["distinct"][i] for r in rows) / len(rows) for i in range(layers)]
    experts, top_k = rows[0]["experts"], rows[0]["top_k"]
    return RouteCheck(decode_tokens=decode_tokens, steps=len(rows), layers=layers, experts=experts, top_k=top_k,
                      distinct_mean=sum(per_layer) / layers, distinct_min=min(min(r["distinct"]) for r in rows),
                      per_layer_mean=[round(x, 2) for x in per_layer],
                      uniform_expectation=uniform_expectation(experts, top_k, decode_tokens))
