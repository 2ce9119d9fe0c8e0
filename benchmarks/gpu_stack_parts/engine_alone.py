"""System (e): loraplex's engine alone, in a process of its own, driven by the load generator's
workload in process (``benchmarks.loadgen.engine_target``).

The parent writes an ``EngineJob`` (the Serve config whose engine section loraplex runs, fields
replaced for this job, the adapter folders, the phases' load specs) and runs
``python -m benchmarks.gpu_stack_parts.engine_alone JOB OUT`` as a child process of its own
(``benchmarks.stacks.process.ChildProcess``: normal scheduling, everything it started stopped);
the child starts the engine, runs loraplex's built-in shape warm-up where the engine section has it
on (as a replica does before it is ready), the shape sweep every system gets, then every phase
back to back, and writes an ``EngineOutput``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from app.engine.shape_warmup import ShapeWarmupReport
from benchmarks.gpu_stack_parts.models import PhaseResult, ShapeSweep, wall_clock
from benchmarks.gpu_stack_parts.routes import LOG_ENV
from benchmarks.loadgen.spec import LoadResult, LoadSpec


class JobPhase(BaseModel):
    """A phase: its short warm-up and its measured load."""

    name: str
    warmup: LoadSpec | None = Field(None, description="Run first, its records dropped.")
    measure: LoadSpec


class EngineJob(BaseModel):
    """What the child runs."""

    serve_config: Path = Field(description="Serve config whose first application's engine section is the engine.")
    engine_update: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields replaced.")
    adapters: dict[str, Path] = Field(default_factory=dict, description="Adapter id -> PEFT folder.")
    shape_sweep: list[LoadSpec] = Field(default_factory=list, description="The sweep's requests, each sent alone.")
    phases: list[JobPhase] = Field(default_factory=list)


class EngineOutput(BaseModel):
    """What the child wrote."""

    start_s: float | None = Field(None, description="AsyncLLM construction to ready (the built-in warm-up included).")
    shape_warmup: ShapeWarmupReport | None = Field(None, description="The built-in warm-up (None: off).")
    shape_sweep: ShapeSweep | None = None
    phases: list[PhaseResult] = Field(default_factory=list)
    error: str | None = None


async def run_job(job: EngineJob, out_path: Path) -> EngineOutput:
    from benchmarks.gpu_stack_parts.serve_config import engine_config
    from benchmarks.loadgen.engine_target import (
        EngineTarget,
        engine_from_config,
        lora_requests,
    )

    cfg = engine_config(yaml.safe_load(job.serve_config.read_text())).model_copy(update=job.engine_update)
    out = EngineOutput()
    t0 = time.perf_counter()
    engine = engine_from_config(cfg)
    try:
        if cfg.shape_warmup:
            from app.engine import shape_warmup

            out.shape_warmup = await shape_warmup.run(engine, cfg.seed)
        out.start_s = time.perf_counter() - t0
        target = EngineTarget(engine, lora_requests(job.adapters))
        if job.shape_sweep:
            t_sweep = time.perf_counter()
            results = [await target.run_load(spec) for spec in job.shape_sweep]
            out.shape_sweep = sweep_record(job.shape_sweep, results, time.perf_counter() - t_sweep)
        if log := os.environ.get(LOG_ENV):  # the routing check counts the requests' forwards only
            Path(log).write_text("")
        for phase in job.phases:
            warmup_at = wall_clock()
            warm = await target.run_load(phase.warmup) if phase.warmup else None
            measured_at = wall_clock()
            result = await target.run_load(phase.measure)
            out.phases.append(PhaseResult(name=phase.name, warmup_requests=warm.aggregate.requests if warm else 0,
                                          warmup_failures=warm.aggregate.failures if warm else 0, result=result,
                                          warmup_at=warmup_at, measured_at=measured_at, ended_at=wall_clock()))
            out_path.write_text(out.model_dump_json())  # a phase at a time: a killed run keeps its phases
    finally:
        engine.shutdown()
    return out


def sweep_record(specs: list[LoadSpec], results: list[LoadResult], total_s: float) -> ShapeSweep:
    """The ``ShapeSweep`` of one request per spec (``results`` in the same order), printed."""
    records = [r.records[0] for r in results]
    out = ShapeSweep(token_counts=[s.input_len for s in specs],
                     errors={s.input_len: (r.error or "failed")[:200] for s, r in zip(specs, records) if not r.ok},
                     seconds=[round(r.e2e_ms / 1000, 4) if r.e2e_ms is not None else -1.0 for r in records],
                     total_s=round(total_s, 3))
    slowest = max(range(len(out.seconds)), key=out.seconds.__getitem__)
    print(f"shape sweep: {len(specs)} requests of {out.token_counts[0]}..{out.token_counts[-1]} tokens in "
          f"{total_s:.1f} s, {out.failures} failed (slowest: {out.token_counts[slowest]} tokens, "
          f"{out.seconds[slowest]:.2f} s)" + (f"; failed: {out.errors}" if out.errors else ""), flush=True)
    return out


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[0]), Path(argv[1])
    job = EngineJob.model_validate_json(job_path.read_text())
    try:
        out = asyncio.run(run_job(job, out_path))
    except Exception as exc:
        prev = EngineOutput.model_validate_json(out_path.read_text()) if out_path.exists() else EngineOutput()
        prev.error = f"{type(exc).__name__}: {exc}"
        out_path.write_text(prev.model_dump_json())
        raise
    out_path.write_text(out.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
