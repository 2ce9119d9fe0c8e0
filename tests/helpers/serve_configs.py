"""Checks shared by the deploy-config and Helm-chart tests: is a Serve config one loraplex can run?

``serve_config_problems(cfg)`` returns human-readable problems (empty list: fine):
- the document validates against Ray Serve's own ``ServeDeploySchema``;
- each application's ``import_path`` names an importable module (and, when the module is
  importable here, an attribute of it);
- ``args`` validate against ``app.config.AppConfig`` (strict: unknown keys are errors);
- every engine argument the app passes to vLLM (``app.engine.vllm_serving.engine_kwargs``) is a field of
  vLLM 0.24.0's ``AsyncEngineArgs`` (list extracted from the wheel: tests/data), and
  ``max_lora_rank`` is one vLLM 0.24 accepts;
- the engine replica asks Ray for the GPUs its tensor-parallel size needs;
- per-deployment overrides (``deployments:``) name deployments the application really has.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from functools import lru_cache
from typing import Any

from tests.helpers.paths import REPO

DATA = REPO / "tests" / "data"
VLLM_GPU_ARGS = DATA / "vllm_0_24_0_engine_args.json"


@lru_cache(maxsize=1)
def vllm_gpu_args() -> dict[str, Any]:
    """vLLM 0.24.0 engine-argument names (see tests/data/extract_vllm_engine_args.py)."""
    return json.loads(VLLM_GPU_ARGS.read_text())


def engine_argument_problems(engine_kwargs: dict[str, Any]) -> list[str]:
    """Problems of one engine's vLLM keyword arguments against vLLM 0.24.0 (the GPU image)."""
    ref = vllm_gpu_args()
    known = set(ref["engine_args"]) | set(ref["async_engine_args_only"])
    problems = [f"engine argument {k!r} is not a vLLM {ref['vllm_version']} AsyncEngineArgs field"
                for k in engine_kwargs if k not in known]
    rank = engine_kwargs.get("max_lora_rank")
    if rank is not None and rank not in ref["max_lora_ranks"]:
        problems.append(f"max_lora_rank {rank} not accepted by vLLM {ref['vllm_version']} ({ref['max_lora_ranks']})")
    compilation = engine_kwargs.get("compilation_config")
    if isinstance(compilation, dict):
        problems += [f"compilation_config key {k!r} unknown to vLLM {ref['vllm_version']}"
                     for k in compilation if k not in ref["compilation_config_fields"]]
    return problems


def import_path_problems(import_path: str) -> list[str]:
    module_name, _, attr = import_path.partition(":")
    if not attr:
        return [f"import_path {import_path!r} is not 'module:attribute'"]
    if importlib.util.find_spec(module_name) is None:
        return [f"import_path module {module_name!r} not found"]
    module = importlib.import_module(module_name)
    if not callable(getattr(module, attr, None)):
        return [f"import_path {import_path!r}: {module_name} has no callable {attr!r}"]
    return []


def deployment_names(args: dict[str, Any]) -> list[str]:
    """Names of the deployments ``app.main:build_app(args)`` binds (no Ray cluster needed)."""
    from ray.serve import Application

    from app.main import build_app

    names: list[str] = []

    def walk(app: Application) -> None:
        bound = app._bound_deployment
        names.append(bound.name)
        for value in [*bound.init_args, *bound.init_kwargs.values()]:
            if isinstance(value, Application):
                walk(value)

    walk(build_app(args))
    return names


def serve_config_problems(cfg: dict[str, Any]) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from app.config import AppConfig
    from app.engine.vllm_serving import engine_kwargs

    problems: list[str] = []
    try:
        (getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj)(cfg)
    except Exception as exc:  # ray's pydantic-compat error type varies by version
        problems.append(f"not a valid Ray Serve config: {exc}")
    for app_cfg in cfg.get("applications") or []:
        name = app_cfg.get("name", "?")
        problems += [f"{name}: {p}" for p in import_path_problems(app_cfg.get("import_path", ""))]
        try:
            args = AppConfig.model_validate(app_cfg.get("args") or {})
        except ValidationError as exc:
            problems.append(f"{name}: args do not validate against AppConfig: {exc}")
            continue
        problems += [f"{name}: {p}" for p in engine_argument_problems(engine_kwargs(args.engine))]
        gpus = args.engine_deployment.ray_actor_options.get("num_gpus", 0)
        if args.engine.tensor_parallel_size == 1 and gpus != 1:
            problems.append(f"{name}: engine replica asks for num_gpus={gpus}, tensor_parallel_size 1 needs 1")
        overridden = [d.get("name") for d in app_cfg.get("deployments") or []]
        if overridden and app_cfg.get("import_path") == "app.main:build_app":
            unknown = sorted(set(overridden) - set(deployment_names(app_cfg.get("args") or {})))
            if unknown:
                problems.append(f"{name}: deployments overrides name unknown deployments {unknown}")
        if args.engine.max_num_seqs > args.engine_deployment.max_ongoing_requests:
            problems.append(f"{name}: max_ongoing_requests < max_num_seqs starves the engine batch")
    return problems
