"""Where the host time of vLLM's ``add_lora`` of a large adapter goes: vLLM 0.24's worker-side
steps timed one by one on one adapter folder (its files in the page cache, as the disk cache
leaves them).

1. ``read``: ``LoRAModel.from_local_checkpoint`` on the CPU (vLLM's own: safetensors read, dtype);
2. ``restack``: 3-D expert tensors reshaped to ``(experts, rank, in)`` / ``(experts, out, rank)``,
   the ops of ``LoRAModelManager._stack_moe_lora_weights`` (a method of a live manager, so its
   tensor ops are repeated here);
3. ``scale``: ``LoRALayerWeights.optimize`` (vLLM's own: the scaling folded into B);
4. ``pin``: ``pin_memory()`` of every tensor, as the manager does when CUDA is present;
5. ``h2d``: every tensor copied into a GPU buffer of its shape (what activating it in a slot
   moves), synchronised.

With ``--pooled``, the two ways a ``pooled`` load reaches its block of the pinned region, side by
side on the same folder (alternating, each from a fresh read): ``vllm_then_copy`` (steps 2 and 3,
then every tensor copied into a block: what a pooled load did before the restack moved into the
block) and ``restack_into_block`` (``kernels.vllm.expert_restack.restack_pair`` writes the experts
scaled into the block, then the attention layers are scaled and copied after them). The region is
page-locked on a CUDA host, pageable elsewhere. The first read of a tensor's bytes lands in
whichever step touches it first (vLLM's reader maps the file lazily).

    python -m benchmarks.profiling.lora_load FOLDER [--reps 3] [--threads 1,0] [--json OUT] [--pooled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kernels.vllm.expert_restack import restack_pair
from kernels.vllm.lora_pinning import host_tensors
from kernels.vllm.pinned_region import PinnedRegion, footprint

STEPS = ("read", "restack", "scale", "pin", "h2d")
POOLED_WAYS = ("vllm_then_copy", "restack_into_block")
POOLED_STEPS = ("read", "restack", "scale", "copy")  # restack_into_block: restack = into the block, scaled


def _modules(path: Path) -> set[str]:
    """The module suffixes the adapter's tensors name (vLLM's expected-modules check)."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    out = set()
    for n in names:
        stem = n.split(".lora_")[0].removesuffix(".base_layer")
        out.add("experts" if ".experts" in stem else stem.rsplit(".", 1)[-1])
    return out


def _restack(lora, num_experts: int) -> None:
    """vLLM 0.24's 3-D expert reshapes on this model's loras (same ops, same order)."""
    for name in [n for n in lora.loras if n.endswith(".experts")]:
        down, gate_up = lora.loras[name], lora.loras.get(name + ".base_layer")
        for w in (gate_up, down):
            if w is None:
                continue
            w.lora_a = w.lora_a.reshape(num_experts, -1, w.lora_a.shape[-1]).contiguous()
            w.lora_b = w.lora_b.reshape(w.lora_b.shape[0], -1, num_experts).permute(2, 0, 1).contiguous()


def read_as_vllm(path: Path, num_experts: int, times: dict[str, float] | None = None):
    """The adapter as vLLM's manager holds it before pinning: read, restacked, scaled (each
    step's seconds into ``times`` when given); returns the ``LoRAModel``."""
    times = {} if times is None else times
    t = time.perf_counter()
    lora = _read(path)
    times["read"] = time.perf_counter() - t
    t = time.perf_counter()
    _restack(lora, num_experts)
    times["restack"] = time.perf_counter() - t
    t = time.perf_counter()
    for w in lora.loras.values():
        w.optimize()
    times["scale"] = time.perf_counter() - t
    return lora


def _read(path: Path):
    """``LoRAModel.from_local_checkpoint`` on the CPU (vLLM's own: safetensors mapped, dtype)."""
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    peft = PEFTHelper.from_local_dir(str(path), None)
    return LoRAModel.from_local_checkpoint(str(path), _modules(path), peft, lora_model_id=1, device="cpu",
                                           dtype=torch.bfloat16)


def region_for(path: Path) -> PinnedRegion:
    """A region of the folder's tensor bytes (aligned), page-locked on a CUDA host, every page
    touched: as the region a replica reserves at start stands when a load arrives."""
    import torch

    lora = _read(path)
    region = PinnedRegion(footprint(host_tensors(lora)), pin=torch.cuda.is_available())
    region.buffer.zero_()
    return region


def pooled_once(path: Path, num_experts: int, way: str, region: PinnedRegion) -> dict[str, float]:
    """One pooled preparation of ``path`` the ``way`` named (``POOLED_WAYS``) into ``region``
    (``region_for``; empty again when this returns); seconds per step (``POOLED_STEPS``) and the
    bytes that ended in the block."""
    times: dict[str, float] = {}
    if way == "vllm_then_copy":
        lora = read_as_vllm(path, num_experts, times)
        t = time.perf_counter()
        times["bytes"] = float(region.adopt(lora))
        times["copy"] = time.perf_counter() - t
        return times
    if way != "restack_into_block":
        raise ValueError(f"way must be one of {POOLED_WAYS}, not {way!r}")
    t = time.perf_counter()
    lora = _read(path)
    times["read"] = time.perf_counter() - t
    block = region.block(region.nbytes)
    assert block is not None  # sized for it, and empty
    t = time.perf_counter()
    written = 0
    for name in [n for n in lora.loras if n.endswith(".experts")]:
        if (gate_up := lora.loras.get(name + ".base_layer")) is not None:
            written += restack_pair(gate_up, lora.loras[name], num_experts, 0, num_experts, block)
    times["restack"] = time.perf_counter() - t
    t = time.perf_counter()
    for w in lora.loras.values():
        w.optimize()  # the attention layers (the experts' scaling is 1 now)
    times["scale"] = time.perf_counter() - t
    t = time.perf_counter()
    written += region.adopt(lora, block)
    times["copy"] = time.perf_counter() - t
    block.close()
    times["bytes"] = float(written)
    return times


def pooled_table(path: Path, num_experts: int, reps: int) -> tuple[str, dict[str, list[dict[str, float]]]]:
    """Both ways ``reps`` times, alternating; a markdown table of the medians (ms) and the runs."""
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in POOLED_WAYS}
    region = region_for(path)
    for _ in range(reps):
        for way in POOLED_WAYS:
            runs[way].append(pooled_once(path, num_experts, way, region))
            assert region.free_bytes() == region.nbytes  # the adapter is gone, its block back
    lines = ["| way | " + " | ".join(POOLED_STEPS) + " | total | MiB in the block |", "|" + "---|" * (len(POOLED_STEPS) + 3)]
    for way, rs in runs.items():
        med = {s: statistics.median(r[s] for r in rs) * 1e3 for s in POOLED_STEPS}
        total = statistics.median(sum(r[s] for s in POOLED_STEPS) for r in rs) * 1e3
        lines.append(f"| {way} | " + " | ".join(f"{med[s]:.1f}" for s in POOLED_STEPS)
                     + f" | {total:.1f} | {rs[0]['bytes'] / 2**20:.1f} |")
    return "\n".join(lines), runs


def once(path: Path, num_experts: int) -> dict[str, float]:
    import torch

    times: dict[str, float] = {}
    pinned = host_tensors(read_as_vllm(path, num_experts, times))
    times["bytes"] = float(sum(x.numel() * x.element_size() for x in pinned))
    if not torch.cuda.is_available():  # a CPU host: vLLM pins nothing and copies nothing
        return times | {"pin": 0.0, "h2d": 0.0}
    t = time.perf_counter()
    pinned = [x.pin_memory() for x in pinned]
    times["pin"] = time.perf_counter() - t
    gpu = [torch.empty_like(x, device="cuda") for x in pinned]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for g, x in zip(gpu, pinned):
        g.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    times["h2d"] = time.perf_counter() - t
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a PEFT adapter folder (adapter_model.safetensors, adapter_config.json)")
    ap.add_argument("--experts", type=int, default=32, help="experts of the base model (GPT-OSS-20B: 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,0", help="torch intra-op threads to run with, comma-separated (0: "
                    "torch's default here); the engine process's own count depends on how it was started")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--pooled", action="store_true", help="the two ways into the pinned region's block, side by side")
    args = ap.parse_args(argv)
    import torch

    default = torch.get_num_threads()
    if args.pooled:
        out_pooled = {}
        for n in [int(x) or default for x in args.threads.split(",")]:
            torch.set_num_threads(n)
            table, out_pooled[n] = pooled_table(args.folder, args.experts, args.reps)
            print(f"{n} torch threads, median of {args.reps} (ms):\n{table}\n")
        torch.set_num_threads(default)
        if args.json:
            args.json.write_text(json.dumps({"folder": args.folder.name, "pooled_runs_by_threads": out_pooled}, indent=1))
        return
    out, mib = {}, 0.0
    print("| torch threads | " + " | ".join(STEPS) + " | total |\n|" + "---|" * (len(STEPS) + 2))
    for n in [int(x) or default for x in args.threads.split(",")]:
        torch.set_num_threads(n)
        runs = [once(args.folder, args.experts) for _ in range(args.reps)]
        mib = runs[0]["bytes"] / 2**20
        med = {s: statistics.median(r[s] for r in runs) * 1e3 for s in STEPS}
        print(f"| {n} | " + " | ".join(f"{med[s]:.1f}" for s in STEPS) + f" | {sum(med.values()):.1f} |")
        out[n] = runs
    torch.set_num_threads(default)
    print(f"{args.folder.name}: {mib:.1f} MiB; median of {args.reps}, ms")
    if args.json:
        args.json.write_text(json.dumps({"folder": args.folder.name, "mib": mib, "runs_by_threads": out}, indent=1))


if __name__ == "__main__":
    main()
