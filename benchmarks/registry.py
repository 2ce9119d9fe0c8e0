"""Adapter cold start (store → servable) and warm-hit overhead, from a local S3 server on loopback.

Adapters (synthetic random bytes, PEFT names):
- tiny: the embedded tiny Qwen3-MoE, rank 8, attention + per-expert (2-D) experts;
- gpt-oss-20b: GPT-OSS-20B shapes, rank 32, attention + fused 3-D experts, bf16 (~705 MiB),
  published as is (3-D).

Tiers measured through the real ``AdapterSlots`` + ``AdapterCache`` + ``S3AdapterStore``:
- cold:      empty disk cache, not resident → ranged S3 download, sha256 verify, atomic rename,
             ``add_lora`` (no-op engine: vLLM's own tensor load is not included);
- disk-warm: files cached, not registered → ``add_lora`` only;
- warm:      resident → the slot-table lookup and pin/unpin around a request;
- cold with the SDK's CRC32: the cold tier again through a client that leaves boto3's default
  response checksum on (a whole-body CRC32 on the reading thread for objects written in one PUT;
  the store turns it off: the sha256 parts verify every byte). Alternates with the cold tier.

``--upload-part-mib 1024`` publishes each file in one PUT (as ``gpu_stack``'s pushes do), the
default in 32 MiB parts (a multipart object's composite checksum is never checked by the SDK).

Usage: ``python -m benchmarks.registry [--server moto|s3rver] [--reps 5] [--skip-big] [--upload-part-mib N]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from adapters_registry.cache import AdapterCache
from adapters_registry.manifest import BaseModelInfo
from adapters_registry.slots import AdapterSlots
from adapters_registry.stores import open_store
from app.embedded.model import tiny_qwen3_moe_config
from benchmarks.progress import progress
from benchmarks.shapes import GPT_OSS_20B_CONFIG
from benchmarks.synthetic_adapters import synthetic_adapter
from tests.helpers.s3 import S3ServerProcess, s3rver_prefix


class NoopEngine:
    """Accepts every registration instantly (isolates the registry's own cost)."""

    async def add_lora(self, req) -> bool:
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return True


def _tiny_base() -> BaseModelInfo:
    cfg = dict(tiny_qwen3_moe_config().to_dict(), architectures=["Qwen3MoeForCausalLM"])
    return BaseModelInfo.from_config(cfg, name="tiny-qwen3-moe")


def _request(name, int_id, path):
    return (name, int_id, str(path))


def raw_get_s(store, manifest) -> float:
    """Floor: one streamed GET of every file, bytes discarded (no hashing, no disk)."""
    t0 = time.perf_counter()
    for f in manifest.files:
        with store.open_file(manifest, f.name) as body:
            while body.read(8 * 2**20):
                pass
    return time.perf_counter() - t0


def with_sdk_checksums(store):
    """A copy of ``store`` whose client checks boto3's response checksums (the SDK's default)."""
    import copy

    import boto3
    from botocore.config import Config

    crc = copy.copy(store)
    config = store.client.meta.config.merge(Config(response_checksum_validation="when_supported"))
    crc.client = boto3.session.Session().client("s3", endpoint_url=store.endpoint_url, config=config)
    return crc


def _slots(cache_dir: Path) -> AdapterSlots:
    """The real slot table and disk cache under ``cache_dir``, on the no-op engine."""
    return AdapterSlots(NoopEngine(), AdapterCache(cache_dir, 64 * 2**30), 4,
                        request_factory=lambda m, n, p: _request(m.lora_name, n, p))


async def _use_s(slots: AdapterSlots, store, manifest) -> float:
    """Seconds of one request's use of ``manifest`` (loaded first if it is not resident)."""
    t0 = time.perf_counter()
    async with slots.use(store, manifest):
        pass
    return time.perf_counter() - t0


async def cold_s(store, manifest, cache_dir: Path) -> float:
    """The cold tier once, in a cache of its own that is removed afterwards."""
    slots = _slots(cache_dir)
    seconds = await _use_s(slots, store, manifest)
    await slots.clear()
    shutil.rmtree(cache_dir, ignore_errors=True)
    return seconds


async def measure(store, manifest, work: Path, reps: int) -> dict[str, list[float]]:
    out = {"cold": [], "cold_sdk_crc": [], "disk_warm": [], "warm": [], "raw_get": []}
    crc_store = with_sdk_checksums(store)
    for i in progress(range(reps), manifest.lora_name, unit="rep"):
        out["raw_get"].append(await asyncio.to_thread(raw_get_s, store, manifest))
        out["cold_sdk_crc"].append(await cold_s(crc_store, manifest, work / f"crc-{i}"))
        cache_dir = work / f"cache-{i}"
        slots = _slots(cache_dir)
        out["cold"].append(await _use_s(slots, store, manifest))
        await slots.clear()  # unregistered, files stay cached
        out["disk_warm"].append(await _use_s(slots, store, manifest))
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            async with slots.use(store, manifest):
                pass
        out["warm"].append((time.perf_counter() - t0) / n)
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def _fmt(xs: list[float], unit: str) -> str:
    scale = {"s": 1, "ms": 1e3, "us": 1e6}[unit]
    return f"{statistics.median(xs) * scale:.3g} {unit} (min {min(xs) * scale:.3g}, max {max(xs) * scale:.3g})"




def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--server", choices=["moto", "s3rver"], default="moto", help="local S3 server (child process)")
    ap.add_argument("--concurrency", type=int, default=1, help="S3 GETs per file (1: one stream; >1: ranged)")
    ap.add_argument("--upload-part-mib", type=int, default=32, help="publish in parts of this size (1024: one PUT per file)")
    ap.add_argument("--cache-dir", default=None, help="parent folder of the disk cache (default: the system temp dir)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-registry-"))
    rows = []
    try:
        prefix = s3rver_prefix() if args.server == "s3rver" else None
        with S3ServerProcess(args.server, data_dir=work / "s3data", s3rver_prefix=prefix) as s3:
            bucket = s3.make_bucket(f"bench-{uuid.uuid4().hex[:8]}")
            store = open_store(f"s3://{bucket}/adapters", s3.endpoint, concurrency=args.concurrency,
                               part_bytes=args.upload_part_mib << 20)
            cases = [("tiny (rank 8, attn+experts 2-D, fp32)", _tiny_base(), dict(r=8, experts="2d"))]
            if not args.skip_big:
                gpt = BaseModelInfo.from_config(GPT_OSS_20B_CONFIG, name="gpt-oss-20b")
                cases.append(("gpt-oss-20b (rank 32, attn+experts 3-D, bf16)", gpt, dict(r=32, experts="3d", dtype="bfloat16")))
            for label, base, kw in cases:
                src = synthetic_adapter(work / "src", base, **kw)
                t0 = time.perf_counter()
                m = store.publish(src, "bench", "bench", base, target_layout="as_is")
                publish_s = time.perf_counter() - t0
                shutil.rmtree(src)
                cache_parent = Path(tempfile.mkdtemp(prefix="loraplex-bench-cache-", dir=args.cache_dir))
                try:
                    res = asyncio.run(measure(store, m, cache_parent, args.reps))
                finally:
                    shutil.rmtree(cache_parent, ignore_errors=True)
                rows.append((label, m.total_bytes, publish_s, res))
                store.delete("bench")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import boto3
    import moto
    import torch

    print(f"\nregistry cold/warm: {os.cpu_count()} CPUs; Python {platform.python_version()}; torch {torch.__version__}; "
          f"boto3 {boto3.__version__}; {args.server} (moto {moto.__version__}) child process on 127.0.0.1; "
          f"GETs per file {args.concurrency}; published in parts of {args.upload_part_mib} MiB; cache under {args.cache_dir or tempfile.gettempdir()}; reps={args.reps}\n")
    head = ("adapter", "MiB", "publish s", "raw GET (floor)", "cold: S3 → servable", "cold, SDK CRC32 on", "disk-warm: add_lora", "warm hit")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for label, size, pub, res in rows:
        print(" | ".join([label, f"{size / 2**20:.1f}", f"{pub:.2f}", _fmt(res["raw_get"], "s"), _fmt(res["cold"], "s"), _fmt(res["cold_sdk_crc"], "s"),
                          _fmt(res["disk_warm"], "ms"), _fmt(res["warm"], "us")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
