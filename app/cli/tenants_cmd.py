"""``loraplex tenants add NAME`` (prints the new key alone on its last line) and ``tenants list``."""

from __future__ import annotations

import argparse

from app.config import AppConfig


def _tenants_path(args: argparse.Namespace):
    from pathlib import Path

    return Path(args.tenants_file) if args.tenants_file else AppConfig().resolved_tenants_file()


def _add(args: argparse.Namespace) -> int:
    from app.gateway.tenants import TenantsFile

    path = _tenants_path(args)
    doc = TenantsFile.read(path)
    fields = {"operator": args.operator}
    if args.max_concurrency:
        fields["max_concurrency"] = args.max_concurrency
    if args.tokens_per_minute:
        fields["tokens_per_minute"] = args.tokens_per_minute
    key = doc.add_key(args.name, **fields)
    doc.write(path)
    print(f"added a key for tenant {args.name!r} to {path}; it is shown once:")
    print(key)
    return 0


def _list(args: argparse.Namespace) -> int:
    from app.gateway.tenants import TenantsFile

    for t in TenantsFile.read(_tenants_path(args)).tenants:
        flags = " operator" if t.operator else ""
        print(f"{t.name}\tkeys={len(t.key_sha256)}\tadapters={','.join(t.adapters) or '-'}{flags}")
    return 0


def add_subparser(sub) -> None:
    p = sub.add_parser("tenants", help="manage tenants and API keys")
    tsub = p.add_subparsers(dest="tenants_command", required=True)
    a = tsub.add_parser("add", help="add a tenant (or a key to one); prints the key")
    a.add_argument("name")
    a.add_argument("--operator", action="store_true", help="grant the admin API")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--tokens-per-minute", type=int, default=None)
    a.add_argument("--tenants-file", default=None, help="default: $LORAPLEX_HOME/tenants.yaml")
    a.set_defaults(func=_add)
    ls = tsub.add_parser("list", help="list tenants")
    ls.add_argument("--tenants-file", default=None)
    ls.set_defaults(func=_list)
