"""Host cost of the per-step LoRA index conversion: vLLM 0.24's ``convert_mapping`` (a
``list.index`` per token) vs loraplex's (``kernels.vllm.cuda.mapping``), side by side in one run.

Each step with an adapter converts its per-token adapter ids to slots before the forward is
launched; in a prefill step that is host time on the critical path. Workload per size: N tokens
of R requests (prefill: one request per 1600 tokens; decode: one token per request), each
request on one of 8 adapters or none, 8 slots. Both functions get the same mapping and device;
results are checked equal, then each is timed (median of ``--reps`` calls, µs).

Needs vLLM 0.24 (the GPU machine's); runs on CPU or GPU:
``python -m benchmarks.kernels.lora_mapping [--tokens 16,256,1616,8192] [--device cuda]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from kernels.vllm.cuda.mapping import convert_mapping
from kernels.vllm.versions import CUDA, require


def workload(tokens: int, seed: int = 0) -> tuple[SimpleNamespace, list[int | None]]:
    """A step of ``tokens`` tokens (decode below 256: a token per request; else 1600-token
    requests) and the slot table: 8 adapters in 8 slots."""
    rng = random.Random(seed)
    lora_index_to_id = [11 + 7 * i for i in range(8)]
    per_request = 1 if tokens < 256 else 1600
    requests = max(1, -(-tokens // per_request))
    req_ids = [rng.choice(lora_index_to_id + [0]) for _ in range(requests)]
    ids = tuple(req_ids[min(t // per_request, requests - 1)] for t in range(tokens))
    return SimpleNamespace(index_mapping=ids, prompt_mapping=tuple(req_ids)), lora_index_to_id


def median_us(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def main() -> None:
    import vllm
    from vllm.lora.punica_wrapper import utils as punica_utils

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,64,256,1616,8192")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    require(CUDA, "this benchmark (it compares against vLLM 0.24's convert_mapping)", hint="")
    device = torch.device(args.device)
    print(f"vLLM {vllm.__version__}, device {device}, median of {args.reps} calls")
    print("| tokens | requests | vLLM µs | loraplex µs | speed-up |")
    print("|---|---|---|---|---|")
    for n in (int(t) for t in args.tokens.split(",")):
        mapping, table = workload(n)
        call = (mapping, table, 8, 32000, 0, device)
        want, got = punica_utils.convert_mapping(*call), convert_mapping(*call)
        for w, g in zip(want[:4], got[:4]):
            assert torch.equal(w.cpu(), g.cpu()), "results differ"
        assert list(want[4]) == list(got[4])
        theirs = median_us(lambda: punica_utils.convert_mapping(*call), args.reps, device)
        ours = median_us(lambda: convert_mapping(*call), args.reps, device)
        print(f"| {n} | {len(mapping.prompt_mapping)} | {theirs:.1f} | {ours:.1f} | "
              f"{theirs / ours:.2f}× |")


if __name__ == "__main__":
    main()
