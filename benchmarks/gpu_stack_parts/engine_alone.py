"""System (e): loraplex's engine alone, in a process of its own, driven by the load generator's
workload in process (``benchmarks.loadgen.engine_target``).

The parent writes an ``EngineJob`` (the Serve config whose engine section loraplex runs, fields
replaced for this job, the adapter folders, the phases' load specs) and runs
``python -m benchmarks.gpu_stack_parts.engine_alone JOB OUT`` as a child process of its own
(``benchmarks.stacks.process.ChildProcess``: normal scheduling, everything it started stopped);
the child starts the engine, runs every phase back to back and writes an ``EngineOutput``.
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

from benchmarks.gpu_stack_parts.models import PhaseResult
from benchmarks.gpu_stack_parts.routes import LOG_ENV
from benchmarks.loadgen.spec import LoadSpec


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
    phases: list[JobPhase] = Field(default_factory=list)


class EngineOutput(BaseModel):
    """What the child wrote."""

    start_s: float | None = Field(None, description="AsyncLLM construction to ready.")
    phases: list[PhaseResult] = Field(default_factory=list)
    error: str | None = None


async def run_job(job: EngineJob, out_path: Path) -> EngineOutput:
    from app.config import AppConfig
    from benchmarks.loadgen.engine_target import (
        EngineTarget,
        engine_from_config,
        lora_requests,
    )

    args = yaml.safe_load(job.serve_config.read_text())["applications"][0]["args"]
    cfg = AppConfig.model_validate(args).engine.model_copy(update=job.engine_update)
    out = EngineOutput()
    t0 = time.perf_counter()
    engine = engine_from_config(cfg)
    try:
        out.start_s = time.perf_counter() - t0
        if log := os.environ.get(LOG_ENV):  # the routing check counts the requests' forwards only
            Path(log).write_text("")
        target = EngineTarget(engine, lora_requests(job.adapters))
        for phase in job.phases:
            warm = await target.run_load(phase.warmup) if phase.warmup else None
            result = await target.run_load(phase.measure)
            out.phases.append(PhaseResult(name=phase.name, warmup_requests=warm.aggregate.requests if warm else 0,
                                          warmup_failures=warm.aggregate.failures if warm else 0, result=result))
            out_path.write_text(out.model_dump_json())  # a phase at a time: a killed run keeps its phases
    finally:
        engine.shutdown()
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
