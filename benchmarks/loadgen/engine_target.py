"""The load generator's workload driven in process against a vLLM ``AsyncLLM``: no HTTP, no
serving layer, the same requests.

``EngineTarget.run_load(spec)`` does what ``benchmarks.loadgen.client.run_load`` does over HTTP:
the same prompts (``workload.prompt_ids``), the same model of each request
(``workload.model_sequence``), the same closed loop at ``spec.concurrency``, the same token counts
(``ignore_eos``, ``min_tokens`` = ``max_tokens``, ``spec.temperature``), and the same per-request
figures, computed by the same code (``sse.finish_record``) from the time each engine output
arrived and the tokens it carried: TTFT to the first output with tokens, inter-token latencies,
TPOT, tokens/s, end to end. The difference of a served system's figures and these is the cost
of its serving layer. Only the completions workload (token-id prompts) applies here; records
carry no HTTP status (``status`` None).

``engine_from_config`` starts the engine a loraplex replica starts for an
``app.config.EngineConfig`` (vLLM's arguments built by ``app.engine.vllm_serving.build_args``,
the plugin switch and the CPU KV-cache size set as the replica sets them).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.loadgen.closed_loop import run_workers
from benchmarks.loadgen.spec import LoadResult, LoadSpec, RequestRecord
from benchmarks.loadgen.sse import ERROR_BODY_CHARS, StreamState, finish_record
from benchmarks.loadgen.stats import aggregate
from benchmarks.loadgen.workload import model_sequence, prompt_ids


def apply_engine_env(cfg) -> None:
    """The environment a loraplex engine replica sets before it starts vLLM."""
    os.environ["LORAPLEX_MOE_LORA"] = "1" if cfg.moe_lora_plugin else "0"
    if cfg.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gib)


def engine_from_config(cfg):
    """vLLM's ``AsyncLLM`` with the arguments loraplex's engine replica gives it for ``cfg``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.engine.vllm_serving import build_args

    apply_engine_env(cfg)
    engine_args = AsyncEngineArgs.from_cli_args(build_args(cfg))
    return AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER)


def lora_requests(adapters: dict[str, str | Path]) -> dict[str, Any]:
    """One ``LoRARequest`` per adapter id (named by its id, ids 1, 2, ... in the given order)."""
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


class EngineTarget:
    """``spec``'s workload against ``engine`` (an ``AsyncLLM``); ``adapters`` maps the adapter
    ids of the workload to their ``LoRARequest``."""

    def __init__(self, engine: Any, adapters: dict[str, Any]) -> None:
        self.engine, self.adapters = engine, adapters
        self._ids = itertools.count()

    def _sampling(self, spec: LoadSpec):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=spec.output_len, min_tokens=spec.output_len, ignore_eos=True,
                              temperature=spec.temperature, output_kind=RequestOutputKind.DELTA)

    async def send_one(self, spec: LoadSpec, phase: str, index: int, adapter: str | None,
                       t_phase: float, state: StreamState | None = None,
                       token_ids: list[int] | None = None) -> RequestRecord:
        """One request, measured from submission to its last output (its outputs into ``state`` when
        given); ``token_ids``: its prompt when built beforehand."""
        model = spec.target.model_name(adapter)
        prompt = {"prompt_token_ids": token_ids if token_ids is not None else prompt_ids(spec, phase, index)}
        sampling = self._sampling(spec)
        state = state if state is not None else StreamState(spec.endpoint)
        t_send = time.perf_counter()
        rec = RequestRecord(index=index, adapter=adapter, model=model, start_s=t_send - t_phase, status=None,
                            ok=False, expected_output_tokens=spec.output_len)
        tokens = 0
        try:
            lora = self.adapters[adapter] if adapter is not None else None
            async for out in self.engine.generate(prompt, sampling, f"{phase}-{next(self._ids)}", lora_request=lora):
                t = time.perf_counter()
                if state.prompt_tokens is None and out.prompt_token_ids is not None:
                    state.prompt_tokens = len(out.prompt_token_ids)
                k = len(out.outputs[0].token_ids)
                if k:
                    tokens += k
                    state.tokens_seen = tokens
                    state.times.append(t)
                    state.cumulative.append(tokens)
        except Exception as exc:  # noqa: BLE001 - recorded as the request's failure
            rec.error = f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
            rec.e2e_ms = (time.perf_counter() - t_send) * 1000
            return rec
        state.tokens_seen = state.usage_total = tokens
        state.done = True
        return finish_record(rec, state, t_send, time.perf_counter())

    async def closed_loop(self, spec: LoadSpec, phase: str,
                          models: list[str | None]) -> tuple[list[RequestRecord], float]:
        """As ``client.closed_loop``: ``spec.concurrency`` workers, records in index order, wall time."""
        if spec.endpoint != "completions":
            raise ValueError("the in-process target runs the completions workload (token-id prompts) only")

        prompts = [prompt_ids(spec, phase, i) for i in range(len(models))]  # before the phase, as the HTTP client

        async def send(index: int, adapter: str | None, t0: float, state: StreamState | None) -> RequestRecord:
            return await self.send_one(spec, phase, index, adapter, t0, state, prompts[index])

        return await run_workers(spec, models, send)

    async def run_load(self, spec: LoadSpec) -> LoadResult:
        """Warm-up (every model in turn, not counted), then the measured closed loop."""
        warm, _ = await self.closed_loop(spec, "warmup",
                                         model_sequence(spec, "warmup", spec.warmup_requests, "round-robin"))
        records, wall = await self.closed_loop(spec, "measure",
                                               model_sequence(spec, "measure", spec.num_requests, spec.popularity))
        return LoadResult(system=spec.target.name, spec=spec, warmup_requests=len(warm),
                          warmup_failures=sum(not r.ok for r in warm), records=records,
                          aggregate=aggregate(records, wall))
