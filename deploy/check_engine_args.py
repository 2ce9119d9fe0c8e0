"""Check a Serve config's engine arguments with the installed vLLM's own parser and config classes.

    python deploy/check_engine_args.py deploy/h200.yaml [--model-dir DIR] [--full]

For each application: ``args`` → ``AppConfig`` → ``app.engine.vllm_serving.build_args`` (vLLM's
``vllm serve`` argument parser, which refuses unknown fields) → ``AsyncEngineArgs.from_cli_args``.
With ``--full`` it also builds vLLM's whole ``VllmConfig`` (``create_engine_config``): LoRA limits,
cache, scheduler and CUDA-graph settings are then validated exactly as at engine start, without
loading weights. ``--model-dir`` replaces the model with a local folder holding only a
``config.json`` of the same architecture (no weights, no tokenizer), for machines without the
checkpoint. Prints one JSON line per application; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import AppConfig  # noqa: E402


def check_app(app_cfg: dict, model_dir: str | None, full: bool) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from app.engine.vllm_serving import build_args, check_vllm_version

    report: dict = {"application": app_cfg.get("name"), "vllm": check_vllm_version()}
    cfg = AppConfig.model_validate(app_cfg.get("args") or {})
    engine = cfg.engine
    if model_dir:
        engine = engine.model_copy(update={"model": model_dir, "tokenizer": None})
    namespace = build_args(engine)
    if model_dir:
        namespace.skip_tokenizer_init = True  # the stand-in folder has no tokenizer
    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    report["engine_args"] = {k: getattr(engine_args, k) for k in (
        "max_loras", "max_cpu_loras", "max_lora_rank", "enable_lora", "gpu_memory_utilization",
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enforce_eager", "enable_prefix_caching")}
    if full:
        vllm_config = engine_args.create_engine_config()
        lora = vllm_config.lora_config
        report["vllm_config"] = {
            "lora": {"max_loras": lora.max_loras, "max_cpu_loras": lora.max_cpu_loras, "max_lora_rank": lora.max_lora_rank},
            "quantization": vllm_config.model_config.quantization,
            "dtype": str(vllm_config.model_config.dtype),
            "max_model_len": vllm_config.model_config.max_model_len,
            "cudagraph_mode": str(vllm_config.compilation_config.cudagraph_mode),
            "max_cudagraph_capture_size": vllm_config.compilation_config.max_cudagraph_capture_size,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--model-dir", help="local folder with a config.json standing in for the model")
    parser.add_argument("--full", action="store_true", help="also build vLLM's VllmConfig")
    opts = parser.parse_args(argv)
    failed = False
    for app_cfg in yaml.safe_load(opts.config.read_text())["applications"]:
        try:
            report = {"ok": True, **check_app(app_cfg, opts.model_dir, opts.full)}
        except Exception as exc:  # report every failure, then exit non-zero
            failed = True
            report = {"ok": False, "application": app_cfg.get("name"), "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc(limit=3)}
        print(json.dumps({"config": str(opts.config), **report}, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
