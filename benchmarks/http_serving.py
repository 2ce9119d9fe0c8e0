"""HTTP load generator on the OpenAI API: streaming completions at fixed concurrency, per request
and per system, so that several servers (loraplex, stock ``vllm serve --lora-modules``,
ray.serve.llm) are compared side by side with one workload.

Closed loop: N workers, each sending its next request when the previous one ends, for a fixed
number of requests, after a warm-up phase that is not counted (it addresses every model in turn,
so adapter loads and first compiles happen there). One aiohttp connection pool (HTTP/1.1 keep-alive)
sized to the concurrency; the SSE stream is parsed here.

Workload: prompts are lists of random token ids (``prompt: [ints]``, seeded: the same seed replays
the same prompts; prompts differ between phases so that none is served from an earlier phase's
prefix cache); ``ignore_eos`` with ``min_tokens`` = ``max_tokens``, so every request produces
exactly ``--output-len`` tokens. Models: a base model name and adapter ids, addressed through a
template per server (``{adapter}``, ``mybase:{adapter}``), chosen ``uniform``, ``round-robin`` or
``zipf:<s>`` (the i-th given model weighted 1/i^s).

Per request: TTFT (send to the first chunk with non-empty text), inter-token latencies (gaps
between content chunks; a chunk carrying k tokens gives k samples of gap/k), TPOT and output
tokens/s (tokens after the first content chunk over the time from first to last content chunk),
end-to-end latency (send to the end of the stream), HTTP status and error body. Tokens per chunk
come from vLLM's per-chunk usage (``stream_options.continuous_usage_stats``) when the server sends
it, else from the final usage (its total spread evenly over the chunks when it exceeds their
count), else from the chunk count; each record says which (``token_source``). Per phase:
p50/p90/p99 of TTFT, ITL, TPOT and e2e over the requests that succeeded, mean output tokens/s per
request, output tokens over the phase's wall time, requests and failures.

``--vllm-bench`` runs vLLM's own client (``vllm bench serve``, random dataset, same lengths,
concurrency and models) right after each of our phases and prints its figures beside ours. It
sends one bearer key per run (``OPENAI_API_KEY``) and spreads requests over several models with
``--lora-modules`` (the base model's name among them); against per-tenant keys it needs a key
allowed every model (``--vllm-bench-key``; ``--embedded`` uses the demo operator's), else it
covers the models of one key and our phase is repeated on those models for the comparison.

``--embedded`` starts the embedded default stack in a temporary ``LORAPLEX_HOME``, addresses its
base model and demo adapters with their tenants' keys, and stops it at the end.

    .venv/bin/python benchmarks/http_serving.py --embedded --preset cpu-tiny [--vllm-bench]
    .venv/bin/python benchmarks/http_serving.py --preset seed --tokenizer MODEL_DIR \\
        --target loraplex=URL1 --keys-file loraplex=keys.json --base-model loraplex=loraplex-base \\
        --target rayllm=URL2 --model-template rayllm=BASE:{adapter} --base-model rayllm=BASE \\
        --adapters A1,A2,A3 --concurrency C1,C2,C3 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file: the checkout's packages by their full names
    sys.path.insert(0, str(REPO))

import yaml

from benchmarks.loadgen.client import raise_priority, run
from benchmarks.loadgen.report import (
    print_failures,
    print_table,
    print_vllm_comparison,
    write_plot,
    write_report,
)
from benchmarks.loadgen.spec import (
    BenchReport,
    LoadResult,
    LoadSpec,
    TargetSpec,
    VllmBenchResult,
)
from benchmarks.loadgen.vllm_bench import beside
from benchmarks.loadgen.workload import model_vocab, server_model_dir

PRESETS: dict[str, dict[str, Any]] = {
    # the production workload, adapters round-robin
    "seed": {"concurrency": "16", "input_len": 1600, "output_len": 600, "popularity": "round-robin",
             "requests": 160, "warmup": 16},
    # sized for the embedded CPU default on a small machine: base + the demo adapters, round-robin
    "cpu-tiny": {"concurrency": "1,8", "input_len": 32, "output_len": 32, "popularity": "round-robin",
                 "requests": 16, "warmup": 4},
}
DEFAULTS: dict[str, Any] = {"concurrency": "1", "input_len": 128, "output_len": 128, "popularity": "round-robin",
                            "requests": 32, "warmup": None}


def per_target(values: list[str], names: list[str]) -> dict[str, str]:
    """``[NAME=]VALUE`` options: NAME one of the targets, else VALUE applies to every target."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if sep and name in names:
            out[name] = rest
        else:
            out.update({n: v for n in names if n not in out})
    return out


def read_keys(path: str) -> dict[str, str] | list[str]:
    """A keys file: JSON map adapter id (or base model name) -> key, or a JSON list of keys."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
        return data
    if isinstance(data, list) and data and all(isinstance(v, str) for v in data):
        return data
    raise SystemExit(f"{path}: expected a JSON object of strings or a non-empty list of strings")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                    help="a server under test (repeatable)")
    ap.add_argument("--model-template", action="append", default=[], metavar="[NAME=]TEMPLATE",
                    help="adapter model name, e.g. {adapter} or mybase:{adapter} (default {adapter})")
    ap.add_argument("--base-model", action="append", default=[], metavar="[NAME=]MODEL",
                    help="the base model's name on a target (without it the base model is not addressed there)")
    ap.add_argument("--api-key", action="append", default=[], metavar="[NAME=]KEY", help="bearer key of a target")
    ap.add_argument("--keys-file", action="append", default=[], metavar="[NAME=]FILE",
                    help="per-tenant keys of a target: JSON map adapter -> key, or a JSON list cycled")
    ap.add_argument("--adapters", default=None, help="comma-separated adapter ids (popularity order)")
    ap.add_argument("--no-base", action="store_true", help="address the adapters only")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named workload; explicit options override it")
    ap.add_argument("--concurrency", default=None, help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per phase")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests per phase, at least one per model (default: max(concurrency, models))")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--popularity", default=None, help="uniform, round-robin or zipf:<s>")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="default: from --tokenizer or the server's model folder")
    ap.add_argument("--tokenizer", default=None, help="the model's HF folder (vocabulary; vllm bench's tokenizer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-continuous-usage", action="store_true", help="do not ask for usage in every chunk")
    ap.add_argument("--timeout", type=float, default=600.0, help="read timeout of one request, seconds")
    ap.add_argument("--embedded", action="store_true", help="start the embedded default stack, use its demo tenants")
    ap.add_argument("--home", default=None, help="--embedded: a LORAPLEX_HOME to use (default: a new temporary one)")
    ap.add_argument("--vllm-bench", action="store_true", help="also run vllm bench serve after each phase")
    ap.add_argument("--vllm-bench-key", action="append", default=[], metavar="[NAME=]KEY",
                    help="a key allowed every model, for vllm bench (one key per run)")
    ap.add_argument("--one-key", action="store_true",
                    help="with --vllm-bench: our phases send every request with vllm bench's key too, so both "
                         "clients send the same requests (tenancy then treats them as one tenant's)")
    ap.add_argument("--workdir", default=None, help="logs of vllm bench and the stack (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write every record and aggregate here")
    ap.add_argument("--plot", default=None, help="write a PNG of TTFT p50 and tok/s per request by concurrency")
    return ap


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """Preset values overridden by the explicit options."""
    base = dict(DEFAULTS, **PRESETS.get(args.preset or "", {}))
    for key in ("concurrency", "input_len", "output_len", "popularity", "requests", "warmup"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    base["concurrency"] = [int(c) for c in str(base["concurrency"]).split(",") if c.strip()]
    return base


def targets_from_args(args: argparse.Namespace) -> list[TargetSpec]:
    """The --target options with their per-target options."""
    pairs = [t.partition("=") for t in args.target]
    if any(not sep or not url for _, sep, url in pairs):
        raise SystemExit("--target takes NAME=URL")
    names = [n for n, _, _ in pairs]
    tpl = per_target(args.model_template, names)
    base = per_target(args.base_model, names)
    key = per_target(args.api_key, names)
    keys = per_target(args.keys_file, names)
    return [TargetSpec(name=n, base_url=url.rstrip("/"), model_template=tpl.get(n, "{adapter}"),
                       base_model=base.get(n), api_key=key.get(n), keys=read_keys(keys[n]) if n in keys else None)
            for n, _, url in pairs]


def embedded_target(base_url: str, home: Path) -> tuple[TargetSpec, list[str], str | None]:
    """loraplex on the embedded stack: demo adapters with their tenants' keys, the operator key."""
    from app.embedded.setup import DEMO_ADAPTERS, demo_keys

    keys = demo_keys(home)
    per_adapter = {s.adapter_id: keys[s.tenant] for s in DEMO_ADAPTERS}
    config = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    base = config["applications"][0]["args"]["engine"]["served_model_name"]
    per_adapter[base] = keys[DEMO_ADAPTERS[0].tenant]
    operator = next((k for t, k in keys.items() if t == "operator"), None)
    target = TargetSpec(name="loraplex", base_url=base_url, base_model=base, keys=per_adapter)
    return target, [s.adapter_id for s in DEMO_ADAPTERS], operator


def resolve_vocab(args: argparse.Namespace, target: TargetSpec) -> tuple[int, list[int], Path | None]:
    """Vocabulary size, special ids and the model folder (for vllm bench's tokenizer)."""
    folder = Path(args.tokenizer) if args.tokenizer else server_model_dir(target)
    vocab, special = model_vocab(folder) if folder else (None, [])
    vocab = args.vocab_size or vocab
    if not vocab:
        raise SystemExit("vocabulary size unknown: give --vocab-size or --tokenizer MODEL_DIR")
    return vocab, special, folder


def phase_spec(target: TargetSpec, w: dict[str, Any], adapters: list[str], conc: int, args: argparse.Namespace,
               vocab: int, special: list[int]) -> LoadSpec:
    """The LoadSpec of one target at one concurrency."""
    include_base = target.base_model is not None and not args.no_base
    n_models = len(adapters) + include_base
    warmup = w["warmup"] if w["warmup"] is not None else max(conc, n_models)
    return LoadSpec(target=target, adapters=adapters, include_base=include_base, popularity=w["popularity"],
                    endpoint=args.endpoint, input_len=w["input_len"], output_len=w["output_len"],
                    temperature=args.temperature, concurrency=conc, num_requests=w["requests"],
                    warmup_requests=max(warmup, n_models), vocab_size=vocab, exclude_token_ids=special,
                    seed=args.seed, continuous_usage=not args.no_continuous_usage, timeout_s=args.timeout)


def sweep(args: argparse.Namespace, targets: list[TargetSpec], adapters: list[str], w: dict[str, Any],
          bench_keys: dict[str, str], workdir: Path) -> BenchReport:
    """Every target at every concurrency, each phase followed by vllm bench when asked."""
    report = BenchReport(date=time.strftime("%Y-%m-%d %H:%M:%S"), cpus=os.cpu_count(),
                         workload={k: v for k, v in w.items()} | {"adapters": adapters, "preset": args.preset,
                                                                    "endpoint": args.endpoint, "seed": args.seed},
                         runs=[])
    pairs: list[tuple[LoadResult, VllmBenchResult]] = []
    for target in targets:
        if args.one_key and bench_keys.get(target.name):
            target = target.with_one_key(bench_keys[target.name])
        vocab, special, folder = resolve_vocab(args, target)
        for conc in w["concurrency"]:
            spec = phase_spec(target, w, adapters, conc, args, vocab, special)
            print(f"{target.name}: concurrency {conc}, {spec.num_requests} requests "
                  f"(+{spec.warmup_requests} warm-up) ...", flush=True)
            result = run(spec)
            report.runs.append(result)
            if args.vllm_bench:
                pairs.append(cross_check(spec, result, bench_keys.get(target.name), folder, workdir, report))
    print()
    print_table(report.runs)
    print_failures(report.runs)
    if pairs:
        print_vllm_comparison(pairs)
    return report


def cross_check(spec: LoadSpec, ours: LoadResult, bench_key: str | None, folder: Path | None, workdir: Path,
                report: BenchReport) -> tuple[LoadResult, VllmBenchResult]:
    """vllm bench after our phase (``benchmarks.loadgen.vllm_bench.beside``); a run of ours it
    compares with other than the phase joins the report too."""
    if spec.endpoint != "completions" or folder is None:
        skipped = VllmBenchResult(system=spec.target.name, concurrency=spec.concurrency, models=[], assignment="",
                                  rc=-1, note="skipped: needs --endpoint completions and a tokenizer folder")
        report.vllm_bench.append(skipped)
        return ours, skipped
    compared, bench = beside(ours, bench_key, folder, workdir)
    if compared is not ours:
        report.runs.append(compared)
    report.vllm_bench.append(bench)
    return compared, bench


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    w = workload(args)
    if not args.embedded and not args.target:
        raise SystemExit("give --target NAME=URL (one or more) or --embedded")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-http-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    targets = targets_from_args(args)
    adapters = [a for a in (args.adapters or "").split(",") if a]
    names = (["loraplex"] if args.embedded else []) + [t.name for t in targets]
    if len(set(names)) != len(names):
        raise SystemExit(f"target names must differ: {names}")
    bench_keys = per_target(args.vllm_bench_key, names)
    stack = None
    try:
        if args.embedded:
            from app.embedded.setup import init, model_dir
            from tests.helpers.stack import start_stack, stop_stack

            home = init(Path(args.home) if args.home else workdir / "home", progress=False)
            print("starting the embedded stack ...", flush=True)
            stack = start_stack(home, workdir)
            target, demo_adapters, operator = embedded_target(stack.base_url, home)
            targets.insert(0, target)
            adapters = adapters or demo_adapters
            args.tokenizer = args.tokenizer or str(model_dir(home))
            if operator:
                bench_keys.setdefault(target.name, operator)
        print("client priority:", "SCHED_FIFO" if raise_priority() else "normal (SCHED_FIFO not allowed)")
        report = sweep(args, targets, adapters, w, bench_keys, workdir)
    finally:
        if stack is not None:
            stop_stack(stack)
    if args.plot:
        report.notes.append(write_plot(report.runs, Path(args.plot)))
        print(report.notes[-1])
    if args.json:
        write_report(report, Path(args.json))
        print(f"records and aggregates written to {args.json}")
    print(f"logs (stack, vllm bench) in {workdir}")
    failures = sum(r.aggregate.failures for r in report.runs)
    print(f"wall time of the whole command: {time.perf_counter() - t_start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
