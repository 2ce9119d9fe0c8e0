"""The models at the boundary: what a phase addresses and sends, what it measured and what a run reports."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator


class TargetSpec(BaseModel):
    """One server under test and how to address it."""

    name: str = Field(description="System name in tables, JSON and plots.")
    base_url: str = Field(description="Server root, without /v1.")
    model_template: str = Field("{adapter}", description="Model name sent for an adapter; {adapter} is the adapter id.")
    base_model: str | None = Field(None, description="The base model's name on this server; None: not addressed.")
    api_key: str | None = Field(None, exclude=True, repr=False,
                                description="Bearer key for every request that no entry of keys covers.")
    keys: dict[str, str] | list[str] | None = Field(
        None, exclude=True, repr=False,
        description="Per-tenant keys: a map adapter id (or base model name) -> key, or a list cycled over requests.")

    def model_name(self, adapter: str | None) -> str:
        """Wire model name of an adapter id (None: the base model)."""
        if adapter is None:
            if self.base_model is None:
                raise ValueError(f"target {self.name!r} has no base model name")
            return self.base_model
        return self.model_template.format(adapter=adapter)

    def key_for(self, adapter: str | None, index: int) -> str | None:
        """Bearer key of request ``index`` for an adapter id (None: the base model)."""
        if isinstance(self.keys, dict):
            found = self.keys.get(self.base_model if adapter is None else adapter)
            if found is not None:
                return found
        elif self.keys:
            return self.keys[index % len(self.keys)]
        return self.api_key

    def with_one_key(self, key: str) -> TargetSpec:
        """This target with ``key`` on every request (its per-tenant keys dropped)."""
        return self.model_copy(update={"keys": None, "api_key": key})


class LoadSpec(BaseModel):
    """One closed-loop phase: a target, a workload and a concurrency."""

    target: TargetSpec = Field(description="The server and how to address it.")
    adapters: list[str] = Field(default_factory=list, description="Adapter ids addressed, in popularity order.")
    include_base: bool = Field(True, description="Whether the base model is one of the models (first in order).")
    popularity: str = Field("round-robin", description="uniform, round-robin or zipf:<s> over the models.")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="/v1/completions (token-id prompts) or /v1/chat/completions (word prompts).")
    input_len: int = Field(ge=1, description="Prompt tokens (chat: words, the served count is in usage).")
    output_len: int = Field(ge=1, description="Output tokens of every request (ignore_eos, min_tokens = max_tokens).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature.")
    concurrency: int = Field(ge=1, description="Closed-loop workers.")
    staggered_starts: bool = Field(
        False, description="Workers start spread over one request (worker k once the first request has produced "
        "k/concurrency of its tokens), not together: arrivals spread instead of in waves "
        "(benchmarks.loadgen.closed_loop).")
    num_requests: int = Field(ge=1, description="Measured requests.")
    warmup_requests: int = Field(0, ge=0, description="Requests before the measured ones, not counted.")
    vocab_size: int = Field(ge=2, description="Prompt token ids are drawn below this.")
    exclude_token_ids: list[int] = Field(default_factory=list, description="Ids never in a prompt (special tokens).")
    seed: int = Field(0, description="Seed of prompts and model choice.")
    continuous_usage: bool = Field(True, description="Ask for usage in every chunk (vLLM's continuous_usage_stats).")
    timeout_s: float = Field(600.0, gt=0, description="Read timeout of one request.")

    @field_validator("popularity")
    @classmethod
    def _check_popularity(cls, value: str) -> str:
        zipf_s(value)
        return value

    def models(self) -> list[str | None]:
        """Adapter ids in popularity order; None stands for the base model."""
        out: list[str | None] = [None] if self.include_base else []
        out += self.adapters
        if not out:
            raise ValueError("no model to address: give adapters or keep the base model")
        return out


def zipf_s(popularity: str) -> float | None:
    """The exponent of ``zipf:<s>``; None for uniform and round-robin; ValueError otherwise."""
    if popularity in ("uniform", "round-robin"):
        return None
    if popularity.startswith("zipf:"):
        s = float(popularity.split(":", 1)[1])
        if s > 0:
            return s
    raise ValueError(f"popularity must be uniform, round-robin or zipf:<s> with s > 0, not {popularity!r}")


class RequestRecord(BaseModel):
    """What one request measured."""

    index: int = Field(description="Position in the phase's request sequence.")
    adapter: str | None = Field(description="Adapter id; None for the base model.")
    model: str = Field(description="Model name sent.")
    start_s: float = Field(description="Send time, seconds after the phase started.")
    status: int | None = Field(description="HTTP status; None when no response came.")
    ok: bool = Field(description="Status 200, content chunks, no in-stream error, stream ended with [DONE].")
    error: str | None = Field(None, description="Error body or exception text of a failure.")
    prompt_tokens: int | None = Field(None, description="Prompt tokens as the server's usage counts them.")
    output_tokens: int = Field(0, description="Output tokens (usage when sent, else content chunks).")
    expected_output_tokens: int = Field(description="Output tokens asked for.")
    content_chunks: int = Field(0, description="Chunks with non-empty text.")
    token_source: Literal["usage-per-chunk", "usage-total", "chunks"] = Field(
        "chunks", description="Where tokens per chunk came from.")
    max_chunk_tokens: int = Field(0, description="Most tokens one content chunk carried.")
    ttft_ms: float | None = Field(None, description="Send to the first content chunk.")
    e2e_ms: float | None = Field(None, description="Send to the end of the stream.")
    itl_ms: list[float] = Field(default_factory=list,
                                description="Inter-token latencies, one per token after the first chunk.")
    tpot_ms: float | None = Field(None, description="(last - first content chunk) / tokens after the first chunk.")
    tokens_per_s: float | None = Field(None, description="Tokens after the first chunk / (last - first content chunk).")


class Percentiles(BaseModel):
    """Mean and percentiles of one latency, milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float


class PhaseAggregate(BaseModel):
    """The figures of one phase over its measured requests."""

    requests: int = Field(description="Measured requests sent.")
    failures: int = Field(description="Requests that did not succeed.")
    token_mismatches: int = Field(description="Successful requests whose output tokens differ from those asked for.")
    multi_token_chunk_requests: int = Field(description="Successful requests with a content chunk of several tokens.")
    wall_s: float = Field(description="First send to last response end.")
    ttft_ms: Percentiles | None = None
    itl_ms: Percentiles | None = None
    tpot_ms: Percentiles | None = None
    e2e_ms: Percentiles | None = None
    tokens_per_s_per_request: float | None = Field(None, description="Mean output tokens/s of one request.")
    output_throughput_tok_s: float = Field(description="Output tokens of successful requests / wall time.")
    mean_prompt_tokens: float | None = Field(None, description="Mean prompt tokens from usage.")
    mean_output_tokens: float | None = Field(None, description="Mean output tokens of successful requests.")
    errors: dict[str, int] = Field(default_factory=dict, description="Failures by status.")


class LoadResult(BaseModel):
    """One phase: its spec (keys left out), warm-up counts, every record and the aggregate."""

    system: str
    spec: LoadSpec
    warmup_requests: int
    warmup_failures: int
    records: list[RequestRecord]
    aggregate: PhaseAggregate


class VllmBenchResult(BaseModel):
    """Figures of one ``vllm bench serve`` run beside one of our phases."""

    system: str
    concurrency: int
    models: list[str]
    assignment: str
    rc: int
    note: str = ""
    figures: dict[str, float | int | None] = Field(default_factory=dict)


class BenchReport(BaseModel):
    """What a run writes with ``--json``."""

    date: str
    cpus: int | None
    workload: dict[str, Any]
    runs: list[LoadResult]
    vllm_bench: list[VllmBenchResult] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
