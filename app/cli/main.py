"""The ``loraplex`` command: init, serve, tenants, adapters, bench."""

from __future__ import annotations

import argparse
import sys

from app.cli import bench_cmd, serve_cmd, tenants_cmd


def _init(args: argparse.Namespace) -> int:
    from app.embedded.setup import init

    home = init()
    print(f"embedded default ready in {home}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving for MoE LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="build the embedded model, demo adapters and tenants in $LORAPLEX_HOME")
    p.set_defaults(func=_init)
    serve_cmd.add_subparser(sub)
    tenants_cmd.add_subparser(sub)
    bench_cmd.add_subparser(sub)
    try:
        from app.cli.adapters_cmd import add_adapters_subparser
    except ImportError:
        pass
    else:
        add_adapters_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
