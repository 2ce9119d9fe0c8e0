"""``loraplex adapters push|list|rm|pin|unpin``.

push/list/rm work on the store directly (``--store``, default: the app config's store);
pin/unpin/residency ask a running server's admin API (``--url``, operator key in ``--key`` or
``LORAPLEX_API_KEY``), since residency lives in the engine replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _store(args: argparse.Namespace):
    from adapters_registry.stores import open_store
    from app.config import AppConfig

    cfg = AppConfig()
    options = {"part_bytes": args.upload_part_mib << 20} if getattr(args, "upload_part_mib", None) else {}
    return open_store(args.store or cfg.resolved_store_uri(), args.endpoint_url or cfg.s3_endpoint_url, **options)


def _part_mib(text: str) -> int:
    """S3's multipart bounds: parts of 5 MiB to 5 GiB."""
    value = int(text)
    if not 5 <= value <= 5120:
        raise argparse.ArgumentTypeError(f"{value} MiB: S3 parts are 5 to 5120 MiB")
    return value


def _fail(exc: Exception) -> int:
    status = getattr(exc, "http_status", None)
    print(f"error{f' ({status})' if status else ''}: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
    return 2


def _push(args: argparse.Namespace) -> int:
    from adapters_registry.errors import RegistryError
    from adapters_registry.manifest import BaseModelInfo
    from app.cli.progress import byte_progress
    from app.config import AppConfig

    ecfg = AppConfig().engine
    try:
        base = BaseModelInfo.from_model(args.base_model or ecfg.resolved_model())
        with byte_progress(f"push {args.id}") as progress:
            m = _store(args).publish(
                args.dir, args.id, args.tenant, base, max_lora_rank=args.max_lora_rank or ecfg.max_lora_rank,
                target_layout="as_is" if args.keep_layout else "2d", progress=progress,
            )
    except RegistryError as e:
        return _fail(e)
    print(f"published {m.adapter_id} version {m.version} (tenant {m.owner_tenant}, rank {m.rank}, "
          f"experts {m.layout if m.has_expert_lora else 'none'}, {m.total_bytes} bytes)")
    return 0


def _list(args: argparse.Namespace) -> int:
    from adapters_registry.errors import RegistryError

    try:
        manifests = _store(args).list()
    except RegistryError as e:
        return _fail(e)
    if args.json:
        print(json.dumps([m.model_dump(mode="json") for m in manifests], indent=2))
        return 0
    rows = [("ID", "VERSION", "TENANT", "RANK", "EXPERTS", "BYTES", "CREATED")]
    for m in manifests:
        rows.append((m.adapter_id, str(m.version), m.owner_tenant, str(m.rank),
                     m.layout if m.has_expert_lora else "-", str(m.total_bytes), m.created_at.strftime("%Y-%m-%d %H:%M:%S")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _rm(args: argparse.Namespace) -> int:
    from adapters_registry.errors import RegistryError

    try:
        versions = _store(args).delete(args.id)
    except RegistryError as e:
        return _fail(e)
    print(f"deleted {args.id} (versions {', '.join(map(str, versions))})")
    return 0


def _admin_call(args: argparse.Namespace, method: str, path: str) -> int:
    import httpx

    key = args.key or os.environ.get("LORAPLEX_API_KEY")
    if not key:
        print("error: an operator API key is needed (--key or LORAPLEX_API_KEY)", file=sys.stderr)
        return 2
    try:
        r = httpx.request(method, args.url.rstrip("/") + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    except httpx.HTTPError as e:
        return _fail(e)
    print(json.dumps(r.json(), indent=2) if r.headers.get("content-type", "").startswith("application/json") else r.text)
    return 0 if r.status_code < 400 else 2


def _pin(args: argparse.Namespace) -> int:
    return _admin_call(args, "POST", f"/admin/adapters/{args.id}/pin")


def _unpin(args: argparse.Namespace) -> int:
    return _admin_call(args, "POST", f"/admin/adapters/{args.id}/unpin")


def _residency(args: argparse.Namespace) -> int:
    return _admin_call(args, "GET", "/admin/residency")


def add_adapters_subparser(subparsers) -> None:
    p = subparsers.add_parser("adapters", help="push, list, delete and pin adapters")
    sub = p.add_subparsers(dest="adapters_command", required=True)

    def store_opts(q):
        q.add_argument("--store", default=None, help="file:///path or s3://bucket/prefix (default: the app config's store)")
        q.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL)")

    def server_opts(q):
        q.add_argument("--url", default=os.environ.get("LORAPLEX_URL", "http://127.0.0.1:8000"), help="server base URL")
        q.add_argument("--key", default=None, help="operator API key (default: LORAPLEX_API_KEY)")

    q = sub.add_parser("push", help="validate a PEFT adapter folder and publish it as a new version")
    q.add_argument("dir", help="folder with adapter_config.json and adapter_model.safetensors")
    q.add_argument("--id", required=True, help="adapter id (A-Z a-z 0-9 _ . -)")
    q.add_argument("--tenant", required=True, help="owner tenant")
    q.add_argument("--base-model", default=None, help="base model folder to validate against (default: the engine's)")
    q.add_argument("--max-lora-rank", type=int, default=None, help="default: the engine's max_lora_rank")
    q.add_argument("--keep-layout", action="store_true", help="publish fused 3-D expert LoRA as is (no 2-D conversion)")
    q.add_argument("--upload-part-mib", type=_part_mib, default=None,
                   help="S3 multipart part size, MiB (default 32; a file up to it goes in one PUT; S3 allows 5-5120)")
    store_opts(q)
    q.set_defaults(func=_push)

    q = sub.add_parser("list", help="list adapters (latest version of each)")
    q.add_argument("--json", action="store_true", help="print manifests as JSON")
    store_opts(q)
    q.set_defaults(func=_list)

    q = sub.add_parser("rm", help="delete an adapter (all versions)")
    q.add_argument("id")
    store_opts(q)
    q.set_defaults(func=_rm)

    for name, func, helptext in (("pin", _pin, "keep an adapter resident on the serving replicas"),
                                 ("unpin", _unpin, "let an adapter be evicted again")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("id")
        server_opts(q)
        q.set_defaults(func=func)

    q = sub.add_parser("residency", help="show which adapters the engine replicas hold")
    server_opts(q)
    q.set_defaults(func=_residency)
