"""What must hold after every fault, for a running stack (``problems`` returns what does not):

- store: every version that has objects (S3) or a folder (local) has its manifest, and no
  publish leftovers (``.tmp-*``) remain: no partial versions;
- disk cache of every engine replica: nothing in ``tmp/``, every entry complete and verified
  against the manifest written beside its files;
- every engine replica (reached one by one, ``replica_probe``): its engine alive, the slot table
  holding exactly the adapters its vLLM engine has registered, within capacity, and, when no
  request is live, no row with active requests and no request inside the engine.
"""

from __future__ import annotations

import time
from pathlib import Path

from adapters_registry.manifest import MANIFEST_NAME, AdapterManifest
from adapters_registry.stores.local import path_from_uri
from adapters_registry.stores.s3 import parse_s3_uri
from adapters_registry.verify import sha256_file


def store_problems(store_uri: str, s3_client=None) -> list[str]:
    if store_uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(store_uri)
        keys: list[str] = []
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        versions: dict[str, set[str]] = {}
        for key in keys:
            parts = key[len(prefix):].strip("/").split("/")
            if len(parts) == 3 and parts[1].isdigit():
                versions.setdefault(f"{parts[0]}/{parts[1]}", set()).add(parts[2])
        return [f"store: {v} has objects {sorted(names)} but no manifest" for v, names in sorted(versions.items())
                if MANIFEST_NAME not in names]
    root = path_from_uri(store_uri)
    out = [f"store: publish leftover {p}" for p in root.glob("*/.tmp-*")]
    out += [f"store: {p} has no manifest" for p in root.glob("*/*")
            if p.is_dir() and p.name.isdigit() and not (p / MANIFEST_NAME).is_file()]
    return out


def cache_problems(cache_root: Path) -> list[str]:
    """``cache_root``: the folder holding each replica's cache (``<LORAPLEX_HOME>/cache``)."""
    out = []
    for replica_cache in sorted(p for p in cache_root.glob("*") if p.is_dir()):
        out += [f"cache: leftover {p}" for p in (replica_cache / "tmp").rglob("*") if p.is_file()]
        for entry in sorted((replica_cache / "objects").glob("*")):
            try:
                manifest = AdapterManifest.model_validate_json((entry / MANIFEST_NAME).read_bytes())
            except (OSError, ValueError) as exc:
                out.append(f"cache: {entry} has no readable manifest ({exc})")
                continue
            if manifest.content_digest != entry.name:
                out.append(f"cache: {entry} holds {manifest.lora_name} of another digest")
            for f in manifest.files:
                path = entry / f.name
                if not path.is_file() or sha256_file(path) != (f.sha256, f.size):
                    out.append(f"cache: {path} is missing or not the manifest's bytes")
    return out


def replica_problems(views: list[dict], *, live_requests: int = 0, replicas: int | None = None) -> list[str]:
    out = []
    if replicas is not None and len(views) != replicas:
        out.append(f"engine: {len(views)} live replicas instead of {replicas}")
    for v in views:
        name = f"replica {v['replica']}"
        if "error" in v:
            out.append(f"{name}: residency failed: {v['error'][-300:]}")
            continue
        if not v["engine_alive"]:
            out.append(f"{name}: engine dead")
            continue
        table = sorted(row["lora_int_id"] for row in v["slots"])
        if table != v["engine_lora_ids"]:
            out.append(f"{name}: slot table {table} != engine's registered {v['engine_lora_ids']}")
        if len(v["slots"]) > v["capacity"]:
            out.append(f"{name}: {len(v['slots'])} rows above capacity {v['capacity']}")
    if live_requests == 0:
        for v in views:
            if "error" in v:
                continue
            pinned = [row["lora_name"] for row in v["slots"] if row["active_requests"]]
            if pinned:
                out.append(f"replica {v['replica']}: rows {pinned} pinned with no request live")
            if v["engine_requests"]:
                out.append(f"replica {v['replica']}: {v['engine_requests']} requests in the engine with none live")
    return out


def problems(stack, probe, *, s3_client=None, live_requests: int = 0, replicas: int | None = None) -> list[str]:
    """Every invariant of the module doc for ``stack`` (the probe reaches its replicas)."""
    return (store_problems(stack.store_uri, s3_client) + cache_problems(stack.home / "cache")
            + replica_problems(probe.replicas(), live_requests=live_requests, replicas=replicas))


def settled(stack, probe, timeout_s: float = 60, **kw) -> list[str]:
    """``problems`` once they are gone, or those left after ``timeout_s`` (requests a client has
    just seen end may still be unwinding inside a replica for a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = problems(stack, probe, **kw)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)
