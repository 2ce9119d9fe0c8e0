"""The minimal Ray Serve + vLLM app, and its launcher.

The shape of the simplest Ray Serve application around vLLM: a FastAPI ingress deployment that
forwards each ``POST /v1/completions`` to an engine deployment through a streaming handle; the
engine deployment holds one ``AsyncLLM`` and vLLM's own OpenAI serving layer
(``OpenAIServingCompletion``), built from vLLM's command line (``vllm_server.vllm_cli_args``: the
same engine arguments and static ``--lora-modules`` as vLLM's server), so an adapter given at start
is requested by its name in ``model``. Streaming and non-streaming both; errors with vLLM's status
and body. Nothing of loraplex's serving code is used: this is the peer that shows what Ray Serve's
hop costs by itself.

It runs with ``serve run`` of a Serve config whose import path is this module's ``build_app``;
both deployments take ``num_cpus: 0`` (on 2 cores the ingress otherwise never schedules) and
``max_ongoing_requests`` sized for the load (Serve's default of 5 queues at concurrency 8).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from benchmarks.loadgen.spec import TargetSpec
from benchmarks.stacks.process import Launch, Server, ray_env, serve_run_cmd
from benchmarks.stacks.stock_plugin import DEFAULT_STOCK_PLUGINS, stock_env
from benchmarks.stacks.vllm_server import vllm_arg_parser, vllm_cli_args

IMPORT_PATH = f"{__name__}:build_app"
ENGINE_MAX_ONGOING = 64
INGRESS_MAX_ONGOING = 256


def _vllm_serving_names():
    """vLLM's app-state builder and request/error types (module layout of either supported release)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    try:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:
        from vllm.entrypoints.openai.api_server import init_app_state
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return init_app_state, CompletionRequest, ErrorResponse


def _error(status: int, message: str) -> dict[str, Any]:
    return {"status": status, "body": {"error": {"message": message, "type": "BadRequestError", "code": status}}}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Engine:
    """One ``AsyncLLM`` with vLLM's completion serving layer."""

    async def __init__(self, argv: list[str]) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        init_app_state, self.request_cls, self.error_cls = _vllm_serving_names()
        args = vllm_arg_parser().parse_args(argv)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args),
                                                usage_context=UsageContext.OPENAI_API_SERVER)
        state = State()
        await init_app_state(self.engine, state, args, await self.engine.get_supported_tasks())
        self.completion = state.openai_serving_completion
        self.models = state.openai_serving_models

    async def completions(self, body: dict[str, Any]) -> AsyncIterator[Any]:
        """A status item ``{"status", "body"}`` first (``body`` set unless streaming), then the
        SSE chunks of a stream."""
        from pydantic import ValidationError

        try:
            request = self.request_cls.model_validate(body)
        except ValidationError as exc:
            yield _error(400, str(exc))
            return
        result = await self.completion.create_completion(request, None)
        if isinstance(result, self.error_cls):
            yield {"status": int(result.error.code), "body": result.model_dump()}
        elif not request.stream:
            yield {"status": 200, "body": result.model_dump(mode="json", exclude_none=True)}
        else:
            yield {"status": 200, "body": None}
            async for chunk in result:
                yield chunk

    async def list_models(self) -> dict[str, Any]:
        return (await self.models.show_available_models()).model_dump()


api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """``/v1/completions`` and ``/v1/models`` forwarded to the engine deployment."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine
        self.streaming = engine.options(stream=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = await request.json()
        except ValueError:
            head = _error(400, "the body is not JSON")
            return JSONResponse(head["body"], status_code=400)
        stream = self.streaming.completions.remote(body)
        head = await stream.__anext__()
        if head["body"] is not None:
            return JSONResponse(head["body"], status_code=head["status"])
        return StreamingResponse(stream, media_type="text/event-stream")

    @api.get("/v1/models")
    async def models(self):
        return JSONResponse(await self.engine.list_models.remote())


def build_app(args: dict[str, Any]):
    """Serve's builder: ``args`` = ``{"argv": vLLM's command line, "engine_max_ongoing_requests",
    "ingress_max_ongoing_requests"}``."""
    engine = Engine.options(max_ongoing_requests=int(args.get("engine_max_ongoing_requests", ENGINE_MAX_ONGOING)))
    ingress = Ingress.options(max_ongoing_requests=int(args.get("ingress_max_ongoing_requests", INGRESS_MAX_ONGOING)))
    return ingress.bind(engine.bind(list(args["argv"])))


class RayApp(Server):
    """``with RayApp(workdir, model_dir, engine_args, adapters) as target``: ``serve run`` of this
    module's app on a Ray cluster of its own (own temp dir), stopped with SIGINT (SIGTERM aborts
    ``serve run``). ``plugins`` as for ``VllmServer``."""

    kind = "ray-app"

    def __init__(self, workdir: Path, model: str | Path, engine_args: dict[str, Any],
                 adapters: dict[str, Path] | None = None, served_model_name: str = "base",
                 plugins: list[str] | None = DEFAULT_STOCK_PLUGINS, env: dict[str, str] | None = None,
                 name: str | None = None) -> None:
        super().__init__(workdir, name)
        self.model, self.engine_args, self.served_model_name = str(model), dict(engine_args), served_model_name
        self.adapter_paths = dict(adapters or {})
        self.adapters = list(self.adapter_paths)
        self.plugins, self.extra_env = plugins, dict(env or {})

    def serve_config(self) -> dict[str, Any]:
        argv = vllm_cli_args(self.model, self.served_model_name, self.engine_args, self.adapter_paths)
        return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": self.port},
                "applications": [{"name": self.name, "route_prefix": "/", "import_path": IMPORT_PATH,
                                  "args": {"argv": argv}}]}

    def prepare(self) -> Launch:
        config = self.workdir / f"{self.name}-serve-config.yaml"
        config.write_text(yaml.safe_dump(self.serve_config(), sort_keys=False))
        env, ray_tmp = ray_env(self.workdir, {**stock_env(self.workdir, self.plugins), **self.extra_env})
        return Launch(serve_run_cmd(config), env, stop_signal=signal.SIGINT, grace_s=60.0,
                      clean_shm=True, ray_tmp=ray_tmp)

    def target(self) -> TargetSpec:
        return TargetSpec(name=self.name, base_url=self.base_url, base_model=self.served_model_name)
