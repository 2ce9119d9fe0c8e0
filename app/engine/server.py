"""Engine deployment: one vLLM ``AsyncLLM`` with LoRA, vLLM's OpenAI serving layer, adapter slots.

A replica owns one engine (one GPU or TP group; on CPU, the embedded model). Requests arrive from
the gateway with the adapter's manifest already resolved and authorised; the replica's slot table
makes the adapter resident (disk cache → ``add_lora``) and pins it for the request's lifetime.

Return protocol to the gateway (plain data, so it crosses Ray unchanged; ``meta`` is an
``app.request_meta.RequestMeta`` dump, None for internal calls, which are not recorded):
- ``generate`` returns ``{"status": int, "body": dict, "replica": str}`` (+ ``retry_after_s`` on
  errors where retrying can help).
- ``generate_stream`` yields ``{"status": int, "body": dict | None, "replica": str}`` first, then
  SSE strings (``"data: ...\\n\\n"``) when the status is 200: one or more whole events each,
  vLLM's own events in order (``app.stream_coalesce`` joins those ready together).
- Both take ``share``, the request's ``app.engine.fair_share.TenantShare`` (None: no fair share).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal

from ray import serve

from adapters_registry.manifest import AdapterManifest
from app.config import AppConfig
from app.engine import fair_share, shape_warmup
from app.engine.manifests import ManifestCache
from app.engine.start_log import StartLog
from app.errors import EngineUnavailable, NotReady, describe, error_body
from app.observability.engine import EngineRecorder
from app.observability.registry_metrics import ReplicaRegistryMetrics
from app.stream_coalesce import coalesced

logger = logging.getLogger(__name__)
Kind = Literal["chat", "completion"]
CLIENT_CLOSED = 499  # a stream whose consumer left before it ended


def expert_lora_refusal() -> str | None:
    """Why this engine cannot apply MoE-expert LoRA (adapters with it are then refused), or None."""
    from kernels.vllm.capabilities import expert_lora_unavailable_reason

    return expert_lora_unavailable_reason()


class ExpertLoraUnsupported(Exception):
    """An adapter carries expert LoRA that this engine cannot apply (never served silently wrong)."""

    http_status = 422
    error_type = "invalid_request_error"

    def __init__(self, adapter_id: str, reason: str):
        self.message = (
            f"adapter {adapter_id!r} has MoE-expert LoRA weights, which this engine cannot apply: {reason}; "
            "it is refused rather than served without its expert weights (set engine.moe_lora_plugin: true)"
        )
        super().__init__(self.message)


class EngineServer:
    """Serve deployment class (bound in ``app.main``). Invariant: adapters reach the engine only
    through ``self.slots`` (the residency table)."""

    async def __init__(self, config: dict[str, Any]):
        from kernels.vllm.plugin import stack_dumps_from_env

        stack_dumps_from_env()  # LORAPLEX_START_STACKS_S: where a slow start waits (ended by start_log.done)
        self.replica = _replica_name()
        self.start_log = start_log = StartLog(self.replica)
        with start_log.phase("imports"):
            from adapters_registry.cache import AdapterCache
            from adapters_registry.slots import AdapterSlots
            from adapters_registry import stores  # noqa: F401  (boto3's import timed in this phase)
            from app.engine import vllm_serving

        self.cfg = AppConfig.model_validate(config)
        ecfg = self.cfg.engine
        os.environ["LORAPLEX_MOE_LORA"] = "1" if ecfg.moe_lora_plugin else "0"
        if ecfg.cpu_kvcache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(ecfg.cpu_kvcache_space_gib)
        with start_log.phase("engine"):
            self.serving = await vllm_serving.start_engine(ecfg)
        self.shape_warmup = None
        if ecfg.shape_warmup:
            with start_log.phase("shape warm-up"):
                self.shape_warmup = await shape_warmup.run(self.serving.engine, ecfg.seed)
        if ecfg.adapter_pinning == "pooled":
            with start_log.phase("pinned region"):
                await vllm_serving.reserve_pinned_region(self.serving.engine, ecfg)
        self.chat_request_cls, self.completion_request_cls, self.error_cls = vllm_serving.request_types()
        self._error_from_exception = vllm_serving.error_from_exception
        self._vllm = vllm_serving
        self.store = self.cfg.open_store()
        self.recorder = EngineRecorder(self.cfg.observability, self.replica)
        self.registry_metrics = registry_metrics = ReplicaRegistryMetrics(self.recorder.labels, self.replica)
        self.cache = AdapterCache(self.cfg.resolved_cache_dir() / _cache_name(), self.cfg.cache_max_bytes,
                                  observer=registry_metrics)
        self.lora_ops = vllm_serving.ServingLoraOps(self.serving, ecfg.adapter_load_threads, ecfg.adapter_pinning)
        self.slots = AdapterSlots(
            self.lora_ops, self.cache, ecfg.max_cpu_loras,
            base=_base_model_info(ecfg.resolved_model()), max_lora_rank=ecfg.max_lora_rank,
            observer=registry_metrics,
            capacity_bytes=None if ecfg.max_cpu_lora_gib is None else int(ecfg.max_cpu_lora_gib * 2**30),
        )
        self.expert_lora_refusal = expert_lora_refusal()
        self.fair_share = (fair_share.EngineFairShare(ecfg.heavy_tenant_backlog_tokens, ecfg.heavy_tenant_stream_interval)
                           if vllm_serving.uses_priorities(ecfg) else None)
        self._shape_request = vllm_serving.shape_request
        self.started_at = time.time()  # the router packs onto older replicas (Serve stops the newest)
        self._newest_version: dict[str, int] = {}  # per adapter id: newest version requested here
        self.manifests = ManifestCache()  # validated once per (adapter, version), not per request
        start_log.done()

    def __del__(self) -> None:
        """Replica shutdown (Serve calls this on the replica's event loop; garbage collection
        too): vLLM's engine stops with its engine-core process. On the loop its sockets close at
        once; off it vLLM only schedules their close on that loop."""
        serving = getattr(self, "serving", None)  # None: __init__ did not get that far
        if serving is not None:
            serving.engine.shutdown()

    async def check_health(self) -> None:
        """Serve health check: raises if the vLLM engine died; records the residency gauges again."""
        await self.serving.engine.check_health()
        self.registry_metrics.refresh()

    async def ready(self) -> bool:
        """True once a real one-token generation on the base model succeeds."""
        out = await self.generate("completion", {"prompt": "hello", "max_tokens": 1, "temperature": 0}, None)
        if out["status"] != 200:
            raise NotReady(f"engine generation failed: {out['body']}")
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this periodically; ``app.routing.router`` ranks replicas by it (a replica
        whose engine died gets no requests while Serve's health checks replace it)."""
        return {"resident": self.slots.resident(), "free_slots": self.slots.free_slots,
                "loadable_slots": self.slots.loadable_slots, "active": self.slots.active(),
                "max_loras": self.cfg.engine.max_loras,
                "batch_capacity": self.cfg.engine.max_num_seqs, "started_at": self.started_at,
                "engine_alive": not self._vllm.engine_dead(self.serving)}

    async def residency(self) -> dict[str, Any]:
        """The slot table (LRU order), the adapters the vLLM engine has registered (its
        ``lora_int_id``s: always those of the table; None once the engine died), the requests
        it holds, the disk cache of this replica, what its shape warm-up ran (None: off) and the
        phases of its start."""
        alive = not self._vllm.engine_dead(self.serving)
        return {
            "replica": self.replica,
            "capacity": self.slots.capacity,
            "capacity_bytes": self.slots.capacity_bytes,
            "registered_bytes": self.slots.registered_bytes,
            "free_slots": self.slots.free_slots,
            "slots": self.slots.snapshot(),
            "engine_alive": alive,
            "engine_lora_ids": sorted(await self.lora_ops.list_loras()) if alive else None,
            "engine_requests": self._vllm.unfinished_requests(self.serving),
            "cache": {"used_bytes": self.cache.used_bytes, "entries": self.cache.snapshot()},
            "shape_warmup": self.shape_warmup.model_dump() if self.shape_warmup else None,
            "start_phases": [p.model_dump() for p in self.start_log.phases],
        }

    async def pin_adapter(self, manifest: dict) -> dict[str, Any]:
        """Operator pin: load the adapter if needed and keep it resident until unpinned."""
        m = AdapterManifest.model_validate(manifest)
        self._check_applicable(m)
        await self.slots.pin(self.store, m)
        return await self.residency()

    def unpin_adapter(self, adapter_id: str) -> dict[str, Any]:
        return {"rows_unpinned": self.slots.unpin(adapter_id)}

    def _check_applicable(self, manifest: AdapterManifest) -> None:
        if manifest.has_expert_lora and self.expert_lora_refusal is not None:
            raise ExpertLoraUnsupported(manifest.adapter_id, self.expert_lora_refusal)

    @asynccontextmanager
    async def _adapter(self, manifest: AdapterManifest | None, obs=None):
        """Yields the engine-side model name for the request, pinning the adapter meanwhile; a
        load the request waited for goes into its log record (``obs``)."""
        if manifest is None:
            yield self.cfg.engine.served_model_name
            return
        self._check_applicable(manifest)
        arrived = time.monotonic()
        if self._newest_version.get(manifest.adapter_id, 0) < manifest.version:
            self._newest_version[manifest.adapter_id] = manifest.version
            await self.slots.retire(manifest.adapter_id, keep_version=manifest.version)
        async with self.slots.use_slot(self.store, manifest) as slot:
            if obs is not None and slot.loaded_at is not None and slot.loaded_at >= arrived:
                obs.adapter_load = slot.load_steps
            yield slot.request.lora_name

    def _parse(self, kind: Kind, body: dict[str, Any], model_name: str, request_id: str | None = None, ticket=None):
        cls = self.chat_request_cls if kind == "chat" else self.completion_request_cls
        fields = {**body, "model": model_name} | ({"request_id": request_id} if request_id else {})
        request = cls.model_validate(fields)
        self._shape_request(request, fair_share.EngineFairShare.priority(ticket),
                            self.fair_share.stream_interval(ticket) if self.fair_share is not None else None)
        handler = self.serving.chat.create_chat_completion if kind == "chat" else self.serving.completion.create_completion
        return request, handler

    def _error(self, exc: Exception) -> dict[str, Any]:
        """An exception as the protocol's error item: ours and the registry's keep their status,
        invalid bodies are 400, everything else goes through vLLM's own mapping."""
        from pydantic import ValidationError

        if self._vllm.engine_dead(self.serving):
            exc = self._engine_unavailable()
        if hasattr(exc, "http_status"):
            status, body, retry = describe(exc)
            return {"status": status, "body": body, "retry_after_s": retry}
        if isinstance(exc, ValidationError):
            return {"status": 400, "body": _validation_body(exc)}
        status, body = self._error_from_exception(exc)
        return {"status": status, "body": body}

    async def generate(self, kind: Kind, body: dict[str, Any], manifest: dict | None,
                       meta: dict | None = None, share: dict | None = None) -> dict[str, Any]:
        """Non-streaming completion/chat; ``manifest`` is an ``AdapterManifest`` dump or None,
        ``meta`` a ``RequestMeta`` dump, ``share`` a ``fair_share.TenantShare`` dump."""
        obs = self.recorder.start(meta, kind, stream=False)
        out = {**await self._generate(kind, body, manifest, obs, share), "replica": self.replica}
        self.recorder.finish(obs, out["status"])
        return out

    def _engine_unavailable(self) -> EngineUnavailable:
        return EngineUnavailable(f"the engine of replica {self.replica} died; the replica is being replaced, retry",
                                 retry_after_s=1.0)

    def _failed(self, result) -> dict[str, Any]:
        """A vLLM ``ErrorResponse`` as the protocol's error item (503 once the engine died)."""
        if self._vllm.engine_dead(self.serving):
            return self._error(self._engine_unavailable())
        return {"status": int(result.error.code), "body": result.model_dump()}

    def _ticket(self, share: dict | None):
        return self.fair_share.admit(share) if self.fair_share is not None else None

    async def _generate(self, kind: Kind, body: dict[str, Any], manifest: dict | None, obs=None,
                        share: dict | None = None) -> dict[str, Any]:
        ticket, served = self._ticket(share), None
        try:
            if self._vllm.engine_dead(self.serving):
                raise self._engine_unavailable()
            async with self._adapter(self.manifests.get(manifest), obs) as model_name:
                request, handler = self._parse(kind, body, model_name, obs and obs.meta.request_id, ticket)
                request.stream = False
                with self.recorder.bind(obs):
                    result = await handler(request, None)
                if isinstance(result, self.error_cls):
                    return self._failed(result)
                out = result.model_dump(mode="json", exclude_none=True)
                served = fair_share.usage_of_body(out)
                return {"status": 200, "body": out}
        except Exception as exc:  # mapped to an HTTP error, the replica keeps serving
            logger.info("request failed: %r", exc)
            return self._error(exc)
        finally:
            if self.fair_share is not None:
                self.fair_share.finish(ticket, served)

    async def generate_stream(self, kind: Kind, body: dict[str, Any], manifest: dict | None,
                              meta: dict | None = None, share: dict | None = None) -> AsyncIterator[Any]:
        """Streaming completion/chat: a status dict first, then SSE chunks (see module doc)."""
        obs = self.recorder.start(meta, kind, stream=True)
        status, ended = CLIENT_CLOSED, False
        try:
            async for item in self._generate_stream(kind, body, manifest, obs, share):
                if isinstance(item, dict):  # the head, or an error after the stream started
                    status, item = item["status"], {**item, "replica": self.replica}
                yield item
            ended = True
        finally:
            self.recorder.finish(obs, status if status != 200 or ended else CLIENT_CLOSED)

    async def _generate_stream(self, kind: Kind, body: dict[str, Any], manifest: dict | None, obs=None,
                               share: dict | None = None) -> AsyncIterator[Any]:
        ticket, served, strip_usage = self._ticket(share), None, False
        if ticket is not None:
            body, strip_usage = fair_share.ask_stream_usage(body)
        try:
            if self._vllm.engine_dead(self.serving):
                raise self._engine_unavailable()
            async with self._adapter(self.manifests.get(manifest), obs) as model_name:
                request, handler = self._parse(kind, body, model_name, obs and obs.meta.request_id, ticket)
                with self.recorder.bind(obs):
                    result = await handler(request, None)
                if isinstance(result, self.error_cls):
                    yield self._failed(result)
                    return
                yield {"status": 200, "body": None}
                async def metered() -> AsyncIterator[str]:
                    """vLLM's events, the fair share's usage event read (and dropped if the client
                    did not ask for it) before any are joined."""
                    nonlocal served
                    async with aclosing(result) as events:
                        async for event in events:
                            if ticket is not None and (usage := fair_share.usage_of_chunk(event)) is not None:
                                served = usage
                                if strip_usage:
                                    continue
                            yield event

                # SSE chunks ready while the previous item is being sent travel as one item
                async with aclosing(coalesced(metered())) as chunks:  # closed at once if the consumer leaves
                    async for chunk in chunks:
                        yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("stream failed: %r", exc)
            yield self._error(exc)
        finally:
            if self.fair_share is not None:
                self.fair_share.finish(ticket, served)


def _validation_body(exc) -> dict[str, Any]:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]]
    return error_body(400, "invalid request body: " + "; ".join(parts), "invalid_request_error")


def _cache_name() -> str:
    """This replica's disk-cache folder: stable across restarts (so old entries are reused and
    pruned) and distinct among the live replicas of a node (one process's eviction must never
    delete a folder another engine has registered)."""
    try:
        ctx = serve.get_replica_context()
        return f"{ctx.deployment}-{ctx.rank.local_rank}"
    except Exception:
        return "local"


def _base_model_info(model: str):
    """What the registry re-validates adapters against at load; None (logged) if unreadable."""
    from adapters_registry.manifest import BaseModelInfo

    try:
        return BaseModelInfo.from_model(model)
    except Exception as exc:
        logger.warning("adapters will not be re-validated at load: base model config unreadable: %s", exc)
        return None


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"
