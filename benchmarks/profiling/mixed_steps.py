"""The serving steady state's slow step, reproduced offline: a new prompt joining running
decodes (``benchmarks.profiling.step_profile --mixed N``).

While a server decodes ``D`` requests, each new prompt runs in one eager step together with
those ``D`` decode tokens (1600 + 15 tokens in the serving benchmark's steady phase, above the
CUDA-graph sizes). ``mixed_pass`` drives vLLM's ``LLMEngine`` step by step: it starts the
decoders (request i on adapter ``i % adapters``, or none), waits until they all decode, then
adds the prompts one at a time (prompt j on adapter ``j % adapters``), steps until each one's
first token is out, and lets ``gap_steps`` decode-only steps pass before the next. Per prompt
it keeps the time from its submission to its first token (TTFT as the engine gives it) and,
through ``benchmarks.profiling.forward_timer``, every forward's host time and device span: the mixed
forwards (more rows than ``decode_rows``) against the decode ones; through
``benchmarks.profiling.host_sections``, the host time of the MoE layer's pieces per mixed step.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.engine.gpt_oss_dummy import random_prompts
from benchmarks.profiling.chrome_trace import trace_path, write_trace_gz
from benchmarks.profiling.forward_timer import ForwardTimer, summarize
from benchmarks.profiling.host_sections import HostSections, mxfp4_engine_sections


def _step_until(engine, done, limit: int = 10_000) -> None:
    """Steps ``engine`` until ``done(outputs of the step)`` is true (at most ``limit`` steps)."""
    for _ in range(limit):
        if done(engine.step()):
            return
    raise RuntimeError(f"no result within {limit} engine steps")


def _finished(request_id: str):
    """``_step_until``'s test: the step finished ``request_id``."""
    return lambda outs: any(o.request_id == request_id and o.finished for o in outs)


def mixed_pass(llm, decoders: list[list[int]], prompts: list[list[int]], loras: list | None,
               *, gap_steps: int = 2, decode_rows: int = 64, tag: str = "m") -> dict:
    """Runs the workload above on ``llm`` (vLLM's ``LLM``, engine in this process); ``loras``:
    the adapters' ``LoRARequest``s, or None for requests without one. Returns ``ttft_ms``
    (per prompt), ``mixed`` and ``decode`` (``forward_timer.summarize`` of the forwards above /
    at most ``decode_rows`` rows)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    lora = (lambda i: loras[i % len(loras)]) if loras else (lambda i: None)
    keep = SamplingParams(max_tokens=len(prompts) * (gap_steps + 4) + 64, temperature=0.0,
                          ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started: set[str] = set()
    ids = [f"{tag}-d{i}" for i in range(len(decoders))]  # outputs carry the ids given here
    for i, (rid, p) in enumerate(zip(ids, decoders)):
        engine.add_request(rid, {"prompt_token_ids": p}, keep, lora_request=lora(i))

    def all_decoding(outs) -> bool:
        started.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
        return started.issuperset(ids)

    _step_until(engine, all_decoding)
    ttft = []
    with ForwardTimer() as timer, HostSections(mxfp4_engine_sections()) as sections:
        for j, p in enumerate(prompts):
            t0 = time.perf_counter()
            rid = f"{tag}-p{j}"
            engine.add_request(rid, {"prompt_token_ids": p}, one, lora_request=lora(j))
            _step_until(engine, _finished(rid))
            ttft.append((time.perf_counter() - t0) * 1e3)
            for _ in range(gap_steps):
                engine.step()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    mixed = summarize(timer.records, min_tokens=decode_rows + 1)
    return {"ttft_ms": ttft, "mixed": mixed,
            "decode": summarize(timer.records, max_tokens=decode_rows),
            "sections": sections.per_step(mixed["count"])}


def traced_pass(llm, decoders: list[list[int]], prompts: list[list[int]], loras: list | None,
                path: str, tag: str = "t") -> None:
    """``mixed_pass`` under ``torch.profiler`` (host activity and CUDA kernels), written as a
    gzip-compressed Chrome trace to ``path`` (``.json.gz``): the host's launches against the
    GPU's kernels, step by step, for reading where the GPU waits."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        mixed_pass(llm, decoders, prompts, loras, gap_steps=1, tag=tag)
    write_trace_gz(prof, path)


def print_mixed_table(title: str, columns: dict[str, dict]) -> None:
    """One row per column (``mixed_pass`` results): TTFT, and the mixed and decode forwards'
    host time, device span and whole-step host time."""
    print(f"\n{title}: a new prompt joining running decodes; ms (mean; TTFT also p50)")
    print("| column | TTFT mean / p50 | mixed forward host / device | mixed step host "
          "| decode forward host / device |")
    print("|---|---|---|---|---|")
    for label, r in columns.items():
        m, d, t = r["mixed"], r["decode"], r["ttft_ms"]
        mixed = (f"{m['host_ms']:.2f} / {m['device_ms']:.2f} ({m['count']} × "
                 f"{m['tokens_mean']:.0f} rows)") if m["count"] else "—"
        step = f"{m['step_host_ms']:.2f}" if m["count"] else "—"
        dec = f"{d['host_ms']:.2f} / {d['device_ms']:.2f}" if d["count"] else "—"
        print(f"| {label} | {statistics.fmean(t):.1f} / {statistics.median(t):.1f} | {mixed} "
              f"| {step} | {dec} |")
    labels = list(dict.fromkeys(k for r in columns.values() for k in r.get("sections", {})))
    if labels:
        print("\nHost ms per mixed step in named functions (calls per mixed step; the decode "
              "steps between run CUDA graphs: only the LoRA mapping runs there)")
        print("| function | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
        for name in labels:
            cells = [f"{r['sections'][name]['ms']:.2f} ({r['sections'][name]['calls']:.0f})"
                     if name in r.get("sections", {}) else "—" for r in columns.values()]
            print(f"| {name} | " + " | ".join(cells) + " |")


def run_mixed(llm, args, loras, gap: int = 2, trace: str | None = None) -> dict:
    """``mixed_pass`` of ``--mixed`` prompts after a warm-up pass of two: ``--prompts - 1``
    decoders of 32 tokens (``loras``: their adapters, or None), ``gap`` decode-only steps
    between prompts; ``trace``: then a pass of two prompts traced into that file
    (``traced_pass``)."""
    decoders = random_prompts(args.prompts - 1, 32, seed=2)
    prompts = random_prompts(args.mixed + 2, args.prompt_len, seed=3)
    mixed_pass(llm, decoders, prompts[:2], loras, tag="warm")
    result = mixed_pass(llm, decoders, prompts[2:], loras, gap_steps=gap)
    if trace:
        traced_pass(llm, decoders, prompts[:2], loras, trace)
    return result


def trace_file(args, label: str) -> str | None:
    """Where ``--trace DIR`` puts the mixed pass's trace of a column (None without it)."""
    return trace_path(args.trace, "mixed", label)
