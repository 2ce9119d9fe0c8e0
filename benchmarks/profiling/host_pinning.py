"""Page-locking an adapter's host copy and copying it into GPU slots, alone and side by side:
what ``engine.adapter_pinning`` trades (``kernels.vllm.lora_pinning``).

One adapter folder is read as vLLM's manager holds it (``benchmarks.profiling.lora_load``: read,
restack, scale), then, on a CUDA host, in one process, each step on *fresh* page-locked memory
(every pinned copy is kept to the end, so torch's caching host allocator never hands a block
back, as for an adapter the engine has never held):

- ``pin``: ``pin_memory()`` of every tensor (what ``lora_pinning.pin`` does);
- ``pin_arena``: one page-locked region of the adapter's bytes (``kernels.vllm.pinned_region``), every
  tensor copied into a view;
- ``arena_copy``: the same copies into that buffer again, already page-locked (what ``pooled``
  pinning pays: ``kernels.vllm.pinned_region``);
- ``h2d_pinned`` / ``h2d_pageable``: every tensor copied into a GPU buffer of its shape (what an
  activation in a slot moves), synchronised;
- ``h2d_pageable_beside_pin``: the pageable copy while another thread pins a fresh copy (the
  deferred pinning as it ran before it waited for the first activation);
- ``step`` / ``step_beside_pin``: a stand-in for engine steps (``--launches`` small kernel launches,
  a bf16 matmul chain, a synchronise), median and worst ms, alone and while another thread pins
  a fresh copy: how much a pinning in the engine process slows the steps of every stream.

    python -m benchmarks.profiling.host_pinning FOLDER [--reps 3] [--threads 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.profiling.lora_load import read_as_vllm
from kernels.vllm.lora_pinning import host_tensors
from kernels.vllm.pinned_region import PinnedRegion, footprint

COPIES = ("pin", "pin_arena", "arena_copy", "h2d_pinned", "h2d_pageable", "h2d_pageable_beside_pin")


def arena_copy(tensors: list, pin: bool = True) -> tuple[object, list]:
    """``(region, views)``: a ``PinnedRegion`` of exactly the tensors' aligned bytes (page-locked
    when ``pin``), each tensor copied into its own view of it, in order."""
    nbytes = footprint(tensors)
    region = PinnedRegion(nbytes, pin=pin)
    block = region.block(nbytes)
    assert block is not None  # sized for them
    views = [block.put(x) for x in tensors]
    block.close()
    return region, views


def beside(work: Callable[[], object], background: Callable[[], object]) -> tuple[float, float]:
    """``work()`` timed while ``background()`` runs in another thread (started first);
    ``(work seconds, background seconds)``."""
    started, spent = threading.Event(), [0.0]

    def run() -> None:
        t = time.perf_counter()
        started.set()
        background()
        spent[0] = time.perf_counter() - t

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    t = time.perf_counter()
    work()
    elapsed = time.perf_counter() - t
    thread.join()
    return elapsed, spent[0]


class StepStandIn:
    """``launches`` element-wise launches on a small tensor, then ``matmuls`` 2048² bf16 matmuls,
    then a synchronise: a step's host launches and device work in miniature."""

    def __init__(self, launches: int, matmuls: int) -> None:
        import torch

        self.small = torch.zeros(1024, device="cuda")
        self.a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        self.launches, self.matmuls = launches, matmuls

    def __call__(self) -> float:
        import torch

        t = time.perf_counter()
        for _ in range(self.launches):
            self.small.add_(1.0)
        x = self.a
        for _ in range(self.matmuls):
            x = x @ self.a
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def run_for(self, steps: int) -> list[float]:
        return [self() for _ in range(steps)]

    def run_while(self, busy: threading.Event) -> list[float]:
        out = []
        while busy.is_set() or not out:
            out.append(self())
        return out


def _copy_all(gpu: list, src: list) -> None:
    import torch

    for g, x in zip(gpu, src):
        g.copy_(x, non_blocking=True)
    torch.cuda.synchronize()


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one_rep(tensors: list, gpu: list, keep: list, step: StepStandIn, steps: int) -> dict[str, float]:
    """Every measurement once (seconds; ``step*`` in ms: median, worst, count)."""
    out: dict[str, float] = {}

    def pin_fresh() -> None:
        keep.append([x.pin_memory() for x in tensors])

    out["pin"] = _timed(pin_fresh)
    pinned = keep[-1]
    out["pin_arena"] = _timed(lambda: keep.append(arena_copy(tensors)))
    views = keep[-1][1]
    out["arena_copy"] = _timed(lambda: [v.copy_(x) for v, x in zip(views, tensors)])
    out["h2d_pinned"] = _timed(lambda: _copy_all(gpu, pinned))
    out["h2d_pageable"] = _timed(lambda: _copy_all(gpu, tensors))
    out["h2d_pageable_beside_pin"], out["pin_beside_h2d"] = beside(lambda: _copy_all(gpu, tensors), pin_fresh)
    alone = step.run_for(steps)
    busy = threading.Event()
    busy.set()

    def pin_then_clear() -> None:
        try:
            pin_fresh()
        finally:
            busy.clear()

    thread = threading.Thread(target=pin_then_clear)
    thread.start()
    during = step.run_while(busy)
    thread.join()
    for name, xs in (("step", alone), ("step_beside_pin", during)):
        out[f"{name}_p50_ms"] = statistics.median(xs) * 1e3
        out[f"{name}_max_ms"] = max(xs) * 1e3
        out[f"{name}_count"] = float(len(xs))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a PEFT adapter folder (adapter_model.safetensors, adapter_config.json)")
    ap.add_argument("--experts", type=int, default=32, help="experts of the base model (GPT-OSS-20B: 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="torch intra-op threads (the engine's adapter_load_threads)")
    ap.add_argument("--launches", type=int, default=300, help="small kernel launches per stand-in step")
    ap.add_argument("--matmuls", type=int, default=20, help="2048² bf16 matmuls per stand-in step")
    ap.add_argument("--steps", type=int, default=50, help="stand-in steps timed alone per rep")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("host_pinning measures page-locked memory and GPU copies: it needs a CUDA host")
    torch.set_num_threads(args.threads)
    tensors = host_tensors(read_as_vllm(args.folder, args.experts))
    mib = sum(x.numel() * x.element_size() for x in tensors) / 2**20
    gpu = [torch.empty_like(x, device="cuda") for x in tensors]
    step, keep = StepStandIn(args.launches, args.matmuls), []
    step.run_for(5)  # warm: the kernels loaded, the matmul chosen
    runs = [one_rep(tensors, gpu, keep, step, args.steps) for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{args.folder.name}: {len(tensors)} tensors, {mib:.1f} MiB; {args.threads} torch threads; "
          f"median of {args.reps} reps, each on fresh page-locked memory")
    print("| " + " | ".join(COPIES) + " | pin beside that copy |\n|" + "---|" * (len(COPIES) + 1))
    print("| " + " | ".join(f"{med[k] * 1e3:.1f}" for k in COPIES) + f" | {med['pin_beside_h2d'] * 1e3:.1f} |")
    print("(ms)\n\n| stand-in step | p50 ms | worst ms | steps |\n|---|---|---|---|")
    for name in ("step", "step_beside_pin"):
        print(f"| {name} | {med[name + '_p50_ms']:.2f} | {med[name + '_max_ms']:.2f} | {med[name + '_count']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"folder": args.folder.name, "mib": mib, "tensors": len(tensors),
                                         "threads": args.threads, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
