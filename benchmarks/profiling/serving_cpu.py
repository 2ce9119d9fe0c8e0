"""Where a streamed request's CPU goes, per process of the serving stack and per layer inside the
Python ones: the CPU profile behind ``benchmarks/serving.py``'s table.

For each server (``benchmarks.serving``'s launchers, same engine settings, adapters and
workload), after a warm-up phase, one measured closed-loop phase of streaming completions runs
while (1) the CPU time (user + system, ``/proc/<pid>/stat``) of every process under this one is
read before and after, grouped by role (HTTP proxy, gateway replica, engine replica, vLLM engine
core, Ray's own processes, vLLM's API server), and (2) with ``--py-spy``, ``py-spy record``
samples the gateway and engine replicas (vLLM's API server for ``vllm``) at ``--rate`` Hz; each
sample is attributed to the first layer of its stack from the leaf up (SSE formatting in vLLM's
serving layer, vLLM's output processing, Ray Serve's streaming and RPC, ASGI/HTTP, pydantic,
loraplex's code, the event loop itself, idle). CPU on this machine is the bottleneck on two
cores, so CPU milliseconds per request and per output token are what each layer costs.

    python -m benchmarks.profiling.serving_cpu [--servers vllm,loraplex] [--concurrency 8]
        [--requests 64] [--py-spy [--gil]] [--json out.json] [--loraplex-checkout NAME=DIR ...]

CPU time per request is what a change saves even on a machine others load (their processes are
not this one's descendants); wall-clock figures there are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.loadgen.client import raise_priority, run
from benchmarks.serving import adapter_folders, make_launcher, phase_spec, resolve_servers
from benchmarks.serving import build_parser as serving_parser
from benchmarks.stacks.process import cmdline

CLK = os.sysconf("SC_CLK_TCK")
ROLES = (  # first match of the command line wins
    ("gateway replica", ("ServeReplica", "Gateway")),
    ("engine replica", ("ServeReplica", "Engine")),
    ("engine replica", ("ServeReplica", "LLMServer")),  # ray.serve.llm's engine deployment
    ("gateway replica", ("ServeReplica", "OpenAiIngress")),
    ("gateway replica", ("ServeReplica", "Ingress")),
    ("colocated replica (gateway and engine)", ("ServeReplica", ":Server")),  # topology: colocated
    ("vLLM engine core", ("EngineCore",)),
    ("vLLM model worker (forward pass)", ("VLLM::Worker",)),
    ("vLLM model worker (forward pass)", ("multiprocessing.spawn",)),
    ("HTTP proxy (HAProxy)", ("haproxy",)),
    ("HTTP proxy (Serve's Python proxy)", ("ProxyActor",)),
    ("Serve controller", ("ServeController",)),
    ("Ray system (raylet, GCS, agents)", ("raylet",)),
    ("Ray system (raylet, GCS, agents)", ("gcs_server",)),
    ("Ray system (raylet, GCS, agents)", ("agent",)),
    ("vLLM API server", ("vllm.entrypoints",)),
    ("vLLM API server", ("api_server",)),
)
LAYERS = (  # (layer, substrings of a frame's file path); a sample counts for the first layer met from the leaf
    ("SSE formatting (vLLM serving layer)", ("entrypoints/openai/completion/serving", "entrypoints/openai/chat_completion/serving")),
    ("vLLM serving layer (request parse, tokenise)", ("vllm/entrypoints/", "vllm/renderers", "vllm/inputs", "vllm/tokenizers")),
    ("vLLM output processing / detokenise", ("vllm/v1/engine/", "vllm/v1/metrics", "tokenizers", "vllm/outputs")),
    ("loraplex code", ("/app/gateway/", "/app/engine/", "/app/observability/", "/app/stream_coalesce", "/app/routing/",
                       "/adapters_registry/")),
    ("pydantic", ("pydantic",)),
    ("Ray Serve (handles, streaming, replica)", ("ray/serve/",)),
    ("Ray core / gRPC / serialisation", ("ray/_private", "ray/_raylet", "grpc", "ray/util", "cloudpickle", "msgpack")),
    ("ASGI / HTTP (uvicorn, starlette, fastapi)", ("uvicorn", "starlette", "fastapi", "h11", "httptools", "anyio")),
    ("JSON", ("json/",)),
    ("event loop (asyncio, uvloop)", ("asyncio/", "uvloop")),
)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def role_of(cmdline: str) -> str:
    for role, needles in ROLES:
        if all(n in cmdline for n in needles):
            return role
    return "other (launcher, client helpers)"


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def snapshot(exclude: set[int]) -> dict[int, tuple[str, float]]:
    out = {}
    for pid in _descendants(os.getpid()):
        if pid in exclude:
            continue
        cmd, t = cmdline(pid), cpu_s(pid)
        if t is not None and cmd:
            out[pid] = (role_of(cmd), t)
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    roles: Counter[str] = Counter()
    for pid, (role, t) in after.items():
        roles[role] += t - before.get(pid, (role, 0.0))[1]
    return dict(roles)


def layer_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # from the leaf up
        where = frame.replace("(", "(/")  # py-spy writes paths under the working directory relative
        for layer, needles in LAYERS:
            if any(n in where for n in needles):
                return layer
    return "other Python"


NATIVE_LEAVES = ("Worker.main_loop", "Thread.run", "select (selectors", "Condition.wait", "Event.wait")
NATIVE = "native code or waiting (Ray core worker, uvloop, gRPC core: no Python frame)"


def read_raw(path: Path) -> Counter[str]:
    """py-spy's raw (collapsed) output → samples per layer. Without ``--native`` py-spy cannot
    tell a thread waiting inside C (Ray's core worker loop, uvloop, gRPC's core) from one working
    there: samples whose leaf is such a frame are counted apart (``NATIVE``)."""
    layers: Counter[str] = Counter()
    if not path.exists():
        return layers
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1].strip()
        native = not leaf or any(leaf.startswith(n) for n in NATIVE_LEAVES)
        layers[NATIVE if native else layer_of(frames)] += int(count)
    return layers


def _py_spy() -> str:
    """py-spy of this environment (beside its Python), else the one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def start_spies(pids: dict[str, int], outdir: Path, rate: int,
                gil: bool = False) -> list[tuple[str, subprocess.Popen, Path]]:
    spies = []
    outdir.mkdir(parents=True, exist_ok=True)
    for role, pid in pids.items():
        out = outdir / f"py-spy-{role.split()[0]}-{pid}.txt"
        proc = subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                 "--output", str(out), "--nonblocking", *(["--gil"] if gil else [])],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        spies.append((role, proc, out))
    time.sleep(1.0)
    return spies


def stop_spies(spies) -> dict[str, dict[str, int]]:
    out = {}
    for role, proc, path in spies:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out[role] = dict(read_raw(path).most_common())
    return out


def profile_server(kind: str, workdir: Path, home: Path, folders, args, vocab, special) -> list[dict]:
    """One row per concurrency level of ``args``, all on one start of the server ``kind``."""
    launcher = make_launcher(kind, workdir / kind, home, folders, args)
    rows = []
    with launcher as target:
        for concurrency in args.concurrency:
            rows.append(_profile_phase(kind, target, workdir, folders, concurrency, args, vocab, special))
    return rows


def _profile_phase(kind: str, target, workdir: Path, folders, concurrency: int, args, vocab, special) -> dict:
    spec = phase_spec(target, list(folders), concurrency, args, vocab, special)
    run(spec.model_copy(update={"num_requests": spec.warmup_requests, "warmup_requests": 0}))
    mine = {os.getpid()}
    spies = []
    if args.py_spy:
        procs = snapshot(mine)
        wanted = {"gateway replica", "engine replica", "colocated replica (gateway and engine)", "vLLM API server"}
        pids = {}
        for pid, (role, _) in procs.items():
            if role in wanted and role not in pids:
                pids[role] = pid
        spies = start_spies(pids, workdir / f"c{concurrency}", args.rate, args.gil)
        mine |= {p.pid for _, p, _ in spies}
    before = snapshot(mine)
    t0 = time.perf_counter()
    result = run(spec.model_copy(update={"warmup_requests": 0}))
    wall = time.perf_counter() - t0
    after = snapshot(mine)
    layers = stop_spies(spies) if spies else {}
    agg = result.aggregate
    tokens = round((agg.mean_output_tokens or 0) * (agg.requests - agg.failures))
    roles = cpu_by_role(before, after)
    return {"system": kind, "concurrency": spec.concurrency, "requests": agg.requests, "failures": agg.failures,
            "output_tokens": tokens, "wall_s": wall, "out_tok_s": agg.output_throughput_tok_s,
            "ttft_p50_ms": agg.ttft_ms.p50 if agg.ttft_ms else None,
            "cpu_s_by_role": roles, "py_spy_samples_by_layer": layers}


def print_profile(rows: list[dict]) -> None:
    for r in rows:
        total = sum(r["cpu_s_by_role"].values())
        print(f"\n{r['system']}: concurrency {r['concurrency']}, {r['requests']} requests ({r['failures']} failed), "
              f"{r['output_tokens']} output tokens in {r['wall_s']:.1f} s ({r['out_tok_s']:.0f} tok/s, TTFT p50 "
              f"{r.get('ttft_p50_ms') or float('nan'):.1f} ms); "
              f"CPU {total:.1f} s of {2 * r['wall_s']:.1f} core-s available on 2 cores")
        print(f"  {'process role':40} {'CPU s':>7} {'ms/request':>10} {'ms/token':>9}")
        for role, s in sorted(r["cpu_s_by_role"].items(), key=lambda kv: -kv[1]):
            print(f"  {role:40} {s:7.2f} {1000 * s / max(r['requests'], 1):10.1f} {1000 * s / max(r['output_tokens'], 1):9.2f}")
        for role, layers in r["py_spy_samples_by_layer"].items():
            py = sum(c for layer, c in layers.items() if layer != NATIVE) or 1
            print(f"  py-spy, {role}: {sum(layers.values())} samples, {layers.get(NATIVE, 0)} in native code or "
                  f"waiting; the {py} in Python by layer:")
            for layer, c in layers.items():
                if layer != NATIVE:
                    print(f"    {layer:50} {100 * c / py:5.1f} %")


def main(argv: list[str] | None = None) -> int:
    ap = serving_parser()
    ap.description = __doc__.splitlines()[0]
    ap.set_defaults(servers="vllm,loraplex", concurrency="8", no_output_check=True)
    ap.add_argument("--py-spy", action="store_true", help="sample the gateway and engine replicas with py-spy")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--gil", action="store_true",
                    help="py-spy samples only threads holding the GIL (a thread waiting for it is not working)")
    args = ap.parse_args(argv)
    kinds = resolve_servers(args)
    from app.embedded.setup import init, model_dir
    from benchmarks.loadgen.workload import model_vocab

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-cpu-profile-"))
    home = init(workdir / "home", progress=False)
    folders = adapter_folders(home, workdir / "adapters")
    vocab, special = model_vocab(model_dir(home))
    raise_priority()
    rows = [row for k in kinds for row in profile_server(k, workdir, home, folders, args, vocab, special)]
    print_profile(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nconfigs, logs and py-spy files in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
