"""ray.serve.llm's OpenAI app (``build_openai_app``) with one ``LLMConfig``, and its launcher.

The model comes from a local folder (``model_loading_config.model_source``), the engine from the
same engine-argument dict as the other servers (``engine_kwargs``, LoRA on), and adapters from a
``LoraConfig`` whose ``dynamic_lora_loading_path`` is ``s3://bucket/prefix`` on an S3-compatible
server: a local moto server started here (``tests.helpers.s3.S3ServerProcess``), or one given by
endpoint (credentials from the environment). The adapters are uploaded there as
``<prefix>/<adapter>/`` (PEFT files); ray.serve.llm reads the endpoint from ``AWS_ENDPOINT_URL``
and addresses an adapter as ``<base>:<adapter>``. It downloads adapters to a fixed folder of its
own (``RAY_LLM_LORA_CACHE``); the ones this launcher caused are removed at stop.

``serve run`` of ``ray.serve.llm:build_openai_app`` itself (no code of ours in the app). On CPU:
``accelerator_config`` ``cpu``, one placement bundle of 1 CPU, both deployments ``num_cpus: 0``.

Stream batching: ray.serve.llm gathers a stream's chunks for an interval before sending them,
``LLMConfig.experimental_configs["stream_batching_interval_ms"]`` (default: the constant
``MODEL_RESPONSE_BATCH_TIMEOUT_MS`` of ``ray.llm._internal.serve.constants``, 50 ms, read from the
environment variable ``RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS``); ``stream_batching_interval_ms``
here sets it (None: ray.serve.llm's default).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any, Literal

import yaml

from benchmarks.loadgen.spec import TargetSpec
from benchmarks.stacks.process import Launch, Server, ray_env, serve_run_cmd
from benchmarks.stacks.stock_plugin import DEFAULT_STOCK_PLUGINS, stock_env

IMPORT_PATH = "ray.serve.llm:build_openai_app"
RAY_LLM_LORA_CACHE = Path("/tmp/ray/llm/lora/cache")  # ray.serve.llm's LoraModelLoader default, not configurable
BUCKET = "loraplex-bench"
PREFIX = "ray-llm-adapters"
MAX_ONGOING = 64


def upload_adapters(client, bucket: str, prefix: str, adapters: dict[str, Path]) -> None:
    """Every file of each adapter folder to ``s3://bucket/prefix/<adapter>/``."""
    for name, folder in adapters.items():
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{name}/{path.name}")


class RayLlm(Server):
    """``with RayLlm(workdir, model_dir, engine_args, adapters) as target``.

    ``s3_endpoint``: an S3 server to upload the adapters to (the bucket is created when missing);
    None starts moto here. ``plugins`` as for ``VllmServer``. ``accelerator``: ``cpu`` (one CPU
    bundle) or ``gpu`` (ray.serve.llm's defaults)."""

    kind = "ray-llm"

    def __init__(self, workdir: Path, model: str | Path, engine_args: dict[str, Any],
                 adapters: dict[str, Path] | None = None, served_model_name: str = "base",
                 plugins: list[str] | None = DEFAULT_STOCK_PLUGINS, env: dict[str, str] | None = None,
                 name: str | None = None, s3_endpoint: str | None = None, bucket: str = BUCKET,
                 prefix: str = PREFIX, stream_batching_interval_ms: float | None = None,
                 accelerator: Literal["cpu", "gpu"] = "cpu", max_ongoing_requests: int = MAX_ONGOING) -> None:
        super().__init__(workdir, name)
        self.model, self.engine_args, self.served_model_name = str(model), dict(engine_args), served_model_name
        self.adapter_paths = dict(adapters or {})
        self.adapters = list(self.adapter_paths)
        self.plugins, self.extra_env = plugins, dict(env or {})
        self.s3_endpoint, self.bucket, self.prefix = s3_endpoint, bucket, prefix
        self.stream_batching_interval_ms = stream_batching_interval_ms
        self.accelerator, self.max_ongoing_requests = accelerator, max_ongoing_requests
        self._s3 = None
        self._cache_dirs: list[Path] = []

    def llm_config(self) -> dict[str, Any]:
        """The ``LLMConfig`` (as Serve config args)."""
        engine = {k: v for k, v in self.engine_args.items() if v is not None}
        cfg: dict[str, Any] = {
            "model_loading_config": {"model_id": self.served_model_name, "model_source": self.model},
            "engine_kwargs": engine,
            "deployment_config": {"num_replicas": 1, "max_ongoing_requests": self.max_ongoing_requests,
                                  "ray_actor_options": {"num_cpus": 0}},
        }
        if self.adapter_paths:
            engine["enable_lora"] = True
            cfg["lora_config"] = {"dynamic_lora_loading_path": f"s3://{self.bucket}/{self.prefix}",
                                  "max_num_adapters_per_replica": int(engine.get("max_cpu_loras")
                                                                      or engine.get("max_loras") or 1)}
        if self.accelerator == "cpu":
            cfg["accelerator_config"] = {"kind": "cpu"}
            cfg["placement_group_config"] = {"bundles": [{"CPU": 1}]}
        if self.stream_batching_interval_ms is not None:
            cfg["experimental_configs"] = {"stream_batching_interval_ms": self.stream_batching_interval_ms}
        return cfg

    def serve_config(self) -> dict[str, Any]:
        args = {"llm_configs": [self.llm_config()],
                "ingress_deployment_config": {"num_replicas": 1, "max_ongoing_requests": 4 * self.max_ongoing_requests,
                                              "ray_actor_options": {"num_cpus": 0}}}
        return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": self.port},
                "applications": [{"name": self.name, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}]}

    def _s3_env(self) -> dict[str, str]:
        """Starts moto when no endpoint was given; uploads the adapters; the child's S3 env."""
        import boto3

        env: dict[str, str] = {}
        if self.s3_endpoint is None:
            from tests.helpers.s3 import S3ServerProcess

            self._s3 = S3ServerProcess("moto").__enter__()
            self.s3_endpoint = self._s3.endpoint
            env.update(self._s3.credentials())
        client = boto3.session.Session().client("s3", endpoint_url=self.s3_endpoint)
        if self.bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=self.bucket)
        upload_adapters(client, self.bucket, self.prefix, self.adapter_paths)
        env["AWS_ENDPOINT_URL"] = self.s3_endpoint
        return env

    def prepare(self) -> Launch:
        import importlib.util

        missing = [m for m in ("pyarrow", "pandas", "jsonref", "boto3") if importlib.util.find_spec(m) is None]
        if missing:  # else Serve's controller retries the failing import until the start times out
            raise RuntimeError(f"ray.serve.llm needs {', '.join(missing)}: bash scripts/setup.sh --bench")
        s3_env = self._s3_env() if self.adapter_paths else {}
        self._cache_dirs = [RAY_LLM_LORA_CACHE / name for name in self.adapter_paths
                            if not (RAY_LLM_LORA_CACHE / name).exists()]
        config = self.workdir / f"{self.name}-serve-config.yaml"
        config.write_text(yaml.safe_dump(self.serve_config(), sort_keys=False))
        env, ray_tmp = ray_env(self.workdir, {**stock_env(self.workdir, self.plugins), **s3_env, **self.extra_env})
        return Launch(serve_run_cmd(config), env, stop_signal=signal.SIGINT, grace_s=60.0,
                      clean_shm=True, ray_tmp=ray_tmp)

    def target(self) -> TargetSpec:
        return TargetSpec(name=self.name, base_url=self.base_url, base_model=self.served_model_name,
                          model_template=f"{self.served_model_name}:{{adapter}}")

    def release(self) -> None:
        for folder in self._cache_dirs:
            shutil.rmtree(folder, ignore_errors=True)
            Path(f"{folder}.lock").unlink(missing_ok=True)
        if self._s3 is not None:
            self._s3.__exit__(None, None, None)
            self._s3 = None
