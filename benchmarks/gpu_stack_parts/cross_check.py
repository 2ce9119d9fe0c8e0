"""vLLM's own client beside our load generator on one phase of a system (``--vllm-bench``).

Both clients must send the same requests for their figures to be comparable: on a system with
per-tenant keys (loraplex) the fair share orders requests by tenant, so the phase is run once
more with one key allowed every model (the bench operator's) and vllm bench sends that key too;
a system without keys (stock vLLM) is compared with the phase as measured. vllm bench asks for
per-chunk usage as our generator does (``benchmarks.loadgen.vllm_bench.extra_body``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_stack_parts.models import CrossCheck
from benchmarks.loadgen.client import run
from benchmarks.loadgen.spec import LoadResult, LoadSpec
from benchmarks.loadgen.vllm_bench import run_vllm_bench, vllm_bench_plan


def cross_check(phase: str, spec: LoadSpec, measured: LoadResult, one_key: str | None, tokenizer: Path,
                workdir: Path) -> CrossCheck:
    """``spec``: the phase's measured workload (``measured`` its result); ``one_key``: a key that
    may call every model, used on both clients where the target has per-tenant keys."""
    key = spec.target.api_key
    ours = measured
    if spec.target.keys and one_key:
        key = one_key
        spec = spec.model_copy(update={"target": spec.target.model_copy(update={"keys": None, "api_key": key})})
        print(f"{spec.target.name} {phase}: again with one key for every model, for vllm bench beside it", flush=True)
        ours = run(spec)
        ours.system = f"{spec.target.name} (one key)"
    models, key, restricted, note = vllm_bench_plan(spec, key)
    if restricted:  # no key may call every model: compare on the models of one key
        ours = run(spec.model_copy(update={"include_base": None in models,
                                           "adapters": [m for m in models if m is not None]}))
        ours.system = f"{spec.target.name} (restricted)"
    print(f"{spec.target.name} {phase}: vllm bench serve at concurrency {spec.concurrency}", flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    bench = run_vllm_bench(spec, models, key, tokenizer, workdir, note)
    return CrossCheck(phase=phase, ours=ours, bench=bench)
