"""deploy/h200.yaml with only what this host needs changed, and the engine arguments every other
system gets from it.

Changed: the HTTP host (127.0.0.1); ``HF_HOME`` (a folder of the run) and, for the random-weight
model, ``LORAPLEX_BALANCED_DUMMY=1`` in the replicas' environment (and
``LORAPLEX_PROFILE_ADAPTER_LOADS`` where this process has it: profiles of the engine's adapter
loads); the store (``s3://`` on the local S3 server, one GET per file: moto answers a ranged GET
by copying the whole object), the tenants file, the disk cache (a folder of the run, bounded to
what the plan's adapters need at most), the registered adapters' host memory (bounded to what this
host has available); the engine's model (and
``load_format: dummy``, or the CPU settings of the embedded model); one engine replica and one
gateway replica instead of autoscaling (no GPU on the CPU host). Everything else is the file's.

The other systems get the engine arguments loraplex's replica gives vLLM for that engine section
(``app.engine.vllm_serving.engine_kwargs``: the same LoRA targets, slots, rank, batch sizes,
prefix caching), less the model and its served name, which their launchers pass themselves,
loraplex's scheduler and worker methods (vLLM's own instead), and
``disable_log_stats: false``, vLLM's default, which its server's parser cannot take.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from benchmarks.gpu_stack_parts.assets import ModelAssets
from kernels.vllm.lora_loads import PROFILE_ENV
from tests.helpers.paths import REPO

H200_CONFIG = REPO / "deploy" / "h200.yaml"
BALANCED_ENV = {"LORAPLEX_BALANCED_DUMMY": "1"}


def host_config(assets: ModelAssets, workdir: Path, store_uri: str, s3_endpoint: str, tenants_file: Path,
                cache_max_bytes: int | None, source: Path = H200_CONFIG,
                host_lora_max_bytes: int | None = None) -> dict[str, Any]:
    """The Serve config (a dict) loraplex runs here (``host_lora_max_bytes``: the most host memory
    its registered adapters may take here, below the file's ``max_cpu_lora_gib``)."""
    cfg = copy.deepcopy(yaml.safe_load(Path(source).read_text()))
    cfg.setdefault("http_options", {})["host"] = "127.0.0.1"
    app = cfg["applications"][0]
    env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env["HF_HOME"] = str(workdir / "hf")
    if assets.balanced_dummy:
        env.update(BALANCED_ENV)
    if profiles := os.environ.get(PROFILE_ENV):
        env[PROFILE_ENV] = profiles
    args = app["args"]
    args.update(store_uri=store_uri, s3_endpoint_url=s3_endpoint, tenants_file=str(tenants_file),
                cache_dir=str(workdir / "cache"))
    args["s3"] = {**args.get("s3", {}), "download_concurrency": 1}  # moto copies the object per ranged GET
    if cache_max_bytes is not None:
        args["cache_max_bytes"] = min(int(args.get("cache_max_bytes") or cache_max_bytes), cache_max_bytes)
    args["engine"].update(assets.engine)
    if host_lora_max_bytes is not None:
        here = host_lora_max_bytes / 2**30
        args["engine"]["max_cpu_lora_gib"] = min(args["engine"].get("max_cpu_lora_gib") or here, here)
    for name in ("engine_deployment", "gateway_deployment"):
        dep = args[name]
        dep.pop("autoscaling_config", None)
        dep["num_replicas"] = 1
        if not assets.gpu:
            dep["ray_actor_options"] = {**dep.get("ray_actor_options", {}), "num_cpus": 0, "num_gpus": 0}
    return cfg


def engine_config(cfg: dict[str, Any]):
    """The ``app.config.EngineConfig`` of a Serve config's loraplex application."""
    from app.config import AppConfig

    return AppConfig.model_validate(cfg["applications"][0]["args"]).engine


def stock_engine_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments of loraplex's engine for the other systems (no model, no served
    name, nothing left at vLLM's default by being None) and vLLM's own scheduler: first come, first
    served, no adapter slot rotation (``engine_kwargs`` without loraplex's rules)."""
    from app.engine.vllm_serving import engine_kwargs

    kw = engine_kwargs(engine_config(cfg), loraplex_rules=False)
    if kw.get("disable_log_stats") is False:  # vLLM's default, and its server has no --no-disable-log-stats
        del kw["disable_log_stats"]
    return {k: v for k, v in kw.items() if k not in ("model", "served_model_name") and v is not None}


def write_yaml(cfg: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
