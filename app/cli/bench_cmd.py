"""``loraplex bench NAME [ARGS...]``: runs a benchmark script of this checkout.

NAME is a script under ``benchmarks/`` (``serving``, ``registry``, ...) or ``kernels`` for
``kernels/bench.py``; ARGS go to the script unchanged. Each script prints a side-by-side table.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def scripts() -> dict[str, Path]:
    found = {p.stem: p for p in sorted((REPO / "benchmarks").glob("*.py")) if not p.stem.startswith("_")}
    if (REPO / "kernels" / "bench.py").exists():
        found["kernels"] = REPO / "kernels" / "bench.py"
    return found


def _run(args: argparse.Namespace) -> int:
    available = scripts()
    if args.name not in available:
        print(f"unknown benchmark {args.name!r}; available: {', '.join(available) or 'none'}", file=sys.stderr)
        return 2
    sys.argv = [str(available[args.name]), *args.args]
    runpy.run_path(str(available[args.name]), run_name="__main__")
    return 0


def add_subparser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (benchmarks/NAME.py, or 'kernels')")
    p.add_argument("name", help="benchmark name, e.g. serving, registry, kernels")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=_run)
