"""``loraplex bench NAME [ARGS...]``: runs a benchmark script of this checkout.

NAME is a benchmark module under ``benchmarks/`` by its dotted name (``serving``, ``registry``,
``engine.serving``, ``kernels.moe_lora``, ...); ARGS go to it unchanged. Each prints a
side-by-side table. Benchmarks live in the checkout, not in the installed package.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def scripts() -> dict[str, Path]:
    """Benchmark modules of this checkout by dotted name (helpers without ``main`` excluded)."""
    root = REPO / "benchmarks"
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.stem.startswith("_") or "__main__" not in path.read_text(errors="replace"):
            continue
        found[".".join(path.relative_to(root).with_suffix("").parts)] = path
    return found


def _run(args: argparse.Namespace) -> int:
    available = scripts()
    if args.name not in available:
        print(f"unknown benchmark {args.name!r}; available: {', '.join(available) or 'none'}", file=sys.stderr)
        return 2
    sys.argv = [str(available[args.name]), *args.args]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    runpy.run_module(f"benchmarks.{args.name}", run_name="__main__", alter_sys=True)
    return 0


def add_subparser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark of this checkout (benchmarks/...)")
    p.add_argument("name", help="benchmark module, e.g. serving, registry, kernels.moe_lora")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=_run)
