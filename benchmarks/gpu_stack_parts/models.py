"""The models at the boundaries of the stack comparison: what one system's run recorded, the
extra measurements, and the report a run writes."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field, computed_field

from benchmarks.loadgen.spec import LoadResult, VllmBenchResult


class PhaseResult(BaseModel):
    """One phase on one system: its short warm-up's counts and the measured load."""

    name: str = Field(description="Phase name of the plan (the same name on every system, the same prompts).")
    warmup_requests: int = Field(description="Uncounted warm-up requests sent before the phase.")
    warmup_failures: int = Field(description="Warm-up requests that failed.")
    result: LoadResult = Field(description="The measured phase.")
    warmup_at: str | None = Field(None, description="Host wall-clock time the warm-up began (to read server logs by).")
    measured_at: str | None = Field(None, description="Host wall-clock time the measured requests began.")
    ended_at: str | None = Field(None, description="Host wall-clock time the measured requests ended.")


def wall_clock() -> str:
    """This host's wall-clock time, to the millisecond, as the servers' logs print it."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


class ShapeSweep(BaseModel):
    """One base-model request per token-count class (``app.engine.shape_warmup.token_counts``),
    one at a time, before a system's phases: every system's kernels compile their variants here,
    not in a measured phase."""

    token_counts: list[int] = Field(default_factory=list, description="Prompt tokens of each request, in order.")
    seconds: list[float] = Field(default_factory=list, description="Wall seconds of each request.")
    errors: dict[int, str] = Field(default_factory=dict, description="Token count -> why its request failed (a one-token "
                                   "answer whose token decodes to no text ends its stream without a content chunk).")
    total_s: float | None = Field(None, description="Wall seconds of the sweep.")
    error: str | None = Field(None, description="Why no sweep ran.")

    @computed_field(description="Requests that failed.")
    @property
    def failures(self) -> int:
        return len(self.errors)


class ColdStart(BaseModel):
    """A fresh adapter pushed while the server runs, then its first and second request."""

    adapter: str = Field(description="Adapter id, new to the store and to the server.")
    adapter_bytes: int | None = Field(None, description="Bytes of the published adapter files.")
    push_s: float | None = Field(None, description="Wall time of `loraplex adapters push`.")
    cold_ttft_ms: float | None = Field(None, description="TTFT of the first request (S3 to first token).")
    warm_ttft_ms: float | None = Field(None, description="TTFT of the next request to it (another prompt).")
    cold_e2e_ms: float | None = Field(None, description="End to end of the first request.")
    disk_load_s: float | None = Field(None, description="The replica's disk step of its load: download from the store "
                                      "and verify (the cold request's log line, adapter_load.disk_s).")
    add_lora_s: float | None = Field(None, description="vLLM's add_lora of it (adapter_load.add_lora_s).")
    engine_load_s: float | None = Field(None, description="From the replica's miss to add_lora returning: every step "
                                        "of its load (the sum of adapter_load).")
    error: str | None = Field(None, description="Why a figure is missing.")


class RouteCheck(BaseModel):
    """Distinct experts per MoE layer in decode steps of the engine alone (hooks on the routers)."""

    decode_tokens: int = Field(description="Tokens of the forwards counted (one decode step of every request).")
    steps: int = Field(description="Decode steps counted.")
    layers: int = Field(0, description="MoE layers seen per step.")
    experts: int | None = Field(None, description="Experts per layer.")
    top_k: int | None = Field(None, description="Experts per token.")
    distinct_mean: float | None = Field(None, description="Mean over steps and layers.")
    distinct_min: int | None = Field(None, description="Fewest distinct experts of any layer in any step.")
    per_layer_mean: list[float] = Field(default_factory=list, description="Mean over steps, per layer.")
    uniform_expectation: float | None = Field(
        None, description="Expected distinct experts if every token picked top_k experts uniformly at random.")
    error: str | None = Field(None, description="Why the check is missing.")


class CrossCheck(BaseModel):
    """``vllm bench serve`` beside our load generator on one phase's workload, both sending the
    same requests (one key for every model, per-chunk usage asked by both)."""

    phase: str = Field(description="The plan's phase whose workload both clients ran.")
    ours: LoadResult = Field(description="Our generator's run of it with vllm bench's key (the phase itself "
                                         "where the system has no keys).")
    bench: VllmBenchResult = Field(description="vllm bench's run right after.")


class SystemRun(BaseModel):
    """One system of the comparison: how it was started and what it measured."""

    system: str = Field(description="Short name: vllm-base, vllm-lora, ray-llm, loraplex, engine-alone.")
    label: str = Field(description="What the system is.")
    versions: dict[str, str] = Field(default_factory=dict, description="vLLM, torch, Ray, GPU name, driver.")
    command: str | None = Field(None, description="The exact command the system ran as.")
    env: dict[str, str] = Field(default_factory=dict, description="The environment variables that decide its path.")
    started_at: str | None = Field(None, description="Wall-clock time the start began.")
    start_s: float | None = Field(None, description="Seconds from start to ready (a real completion answered).")
    stop_s: float | None = Field(None, description="Seconds the stop took.")
    shape_sweep: ShapeSweep | None = Field(None, description="The token-count sweep before the phases.")
    phases: list[PhaseResult] = Field(default_factory=list)
    cold_starts: list[ColdStart] = Field(default_factory=list)
    route_check: RouteCheck | None = None
    cross_checks: list[CrossCheck] = Field(default_factory=list,
                                           description="vLLM's own client beside ours on phases named by --vllm-bench.")
    log: str | None = Field(None, description="Its log file.")
    error: str | None = Field(None, description="Why it did not run or stopped early.")
    first_start_error: str | None = Field(None, description="Why a first start failed, when it was started twice.")
    notes: list[str] = Field(default_factory=list, description="How this system's run differed from the others'.")


class PushRecord(BaseModel):
    """One `loraplex adapters push`."""

    adapter: str
    tenant: str
    rank: int
    seconds: float = Field(description="Wall time of the command.")
    bytes: int | None = Field(None, description="Bytes published (from the command's output).")
    ok: bool
    output: str = Field("", description="Its last output line.")


class StackReport(BaseModel):
    """What a run writes as JSON."""

    date: str
    command: str = Field(description="The command line of this run.")
    plan: dict[str, Any] = Field(description="The plan that ran.")
    estimate_s: float = Field(description="The plan's estimate, printed before the run.")
    wall_s: float = Field(0.0, description="Wall time of the whole run.")
    host: dict[str, str] = Field(default_factory=dict, description="Versions and hardware of this host.")
    engine: dict[str, Any] = Field(default_factory=dict, description="The engine arguments every system got.")
    pushes: list[PushRecord] = Field(default_factory=list)
    systems: list[SystemRun] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
