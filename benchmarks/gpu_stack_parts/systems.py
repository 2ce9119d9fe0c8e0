"""How each system is started here: the launchers of ``benchmarks.stacks`` with this run's
settings, and the engine-alone child.

Stock servers (a, b, c) get the engine arguments of loraplex's engine section. On a GPU they load
loraplex's vLLM plugin with ``LORAPLEX_MOE_LORA=0`` (stock vLLM) and the balanced-dummy plugin
(``LORAPLEX_BALANCED_DUMMY=1``); on the CPU they load only the fix without which LoRA on an MoE
model cannot run on vLLM-CPU at all (``benchmarks.stacks.stock_plugin``). loraplex (d) and its
engine alone (e) load every installed plugin, loraplex's switch on.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_stack_parts.assets import ModelAssets
from benchmarks.gpu_stack_parts.engine_alone import EngineJob, EngineOutput
from benchmarks.gpu_stack_parts.serve_config import BALANCED_ENV
from benchmarks.stacks.loraplex import LoraplexServer
from benchmarks.stacks.process import ChildProcess, base_env
from benchmarks.stacks.stock_plugin import DEFAULT_STOCK_PLUGINS

GPU_STOCK_PLUGINS = ["loraplex_moe_lora", "loraplex_balanced_dummy"]
PATH_ENV = ("LORAPLEX_MOE_LORA", "LORAPLEX_BALANCED_DUMMY", "VLLM_PLUGINS", "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_USE_FLASHINFER_SAMPLER", "AWS_ENDPOINT_URL", "LPX_ROUTE_LOG")
ENGINE_TIMEOUT_S = 3600.0


def path_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that decide a system's path (recorded with its command)."""
    return {k: env[k] for k in PATH_ENV if k in env}


def stock_settings(assets: ModelAssets) -> tuple[list[str], dict[str, str]]:
    """``(plugins, env)`` of a stock server."""
    if not assets.gpu:
        return list(DEFAULT_STOCK_PLUGINS), {}
    return list(GPU_STOCK_PLUGINS), {"LORAPLEX_MOE_LORA": "0", **BALANCED_ENV}


def loraplex_env(assets: ModelAssets, s3_env: dict[str, str]) -> dict[str, str]:
    return {"LORAPLEX_MOE_LORA": "1", **(BALANCED_ENV if assets.balanced_dummy else {}), **s3_env}


class LoraplexH200(LoraplexServer):
    """loraplex on a Serve config written here (the store, the tenants and the adapters already
    in place): requests carry the key of the adapter's owner, given by the run."""

    def __init__(self, workdir: Path, home: Path, config: Path, keys: dict[str, str], probe: list[str],
                 env: dict[str, str]) -> None:
        super().__init__(workdir, home, adapters=probe, config=config, env=env, name="loraplex")
        self._given_keys = dict(keys)

    def _publish_and_key(self, args: dict[str, Any]) -> None:
        self.keys = dict(self._given_keys)


def ray_llm_import_error(env: dict[str, str]) -> str | None:
    """Why ``ray.serve.llm`` does not import here (its last error line), or None when it does."""
    r = subprocess.run([sys.executable, "-c", "import ray.serve.llm"], check=False, env=base_env(env), capture_output=True,
                       text=True, timeout=600)
    if r.returncode == 0:
        return None
    lines = [line for line in (r.stderr or r.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def run_engine_child(workdir: Path, name: str, job: EngineJob, env: dict[str, str],
                     python_path: list[Path] = ()) -> tuple[EngineOutput, ChildProcess]:
    """Runs ``job`` in a child process (``python_path`` before the checkout on its path); its
    output and the child."""
    job_path, out_path = workdir / f"{name}-job.json", workdir / f"{name}-out.json"
    job_path.write_text(job.model_dump_json(indent=1))
    out_path.unlink(missing_ok=True)
    child_env = base_env(env)
    child_env["PYTHONPATH"] = os.pathsep.join([*map(str, python_path), child_env["PYTHONPATH"]])
    child = ChildProcess(name, [sys.executable, "-m", "benchmarks.gpu_stack_parts.engine_alone", str(job_path),
                                str(out_path)], child_env, workdir / f"{name}.log")
    child.start()
    try:
        rc = child.proc.wait(ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        child.stop()
    out = EngineOutput.model_validate_json(out_path.read_text()) if out_path.exists() else EngineOutput()
    if rc != 0:
        out.error = f"{out.error or f'exit {rc}'}; last lines of {child.log_path}:\n{child.log_tail(25)}"
    return out, child


def command_of(child: ChildProcess | None) -> str | None:
    return shlex.join(child.cmd) if child is not None else None
