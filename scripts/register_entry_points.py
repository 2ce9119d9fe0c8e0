"""Registers this checkout's entry points in a site directory without installing it.

On a host where the checkout is used from ``PYTHONPATH`` (the offline GPU host: packages in a
``--target`` directory, no build tools needed), vLLM still finds its general plugins through
package metadata only. This writes ``loraplex_checkout-0.dist-info`` into ``--target`` with the
entry points of ``pyproject.toml`` (loraplex's vLLM plugin, the ``loraplex`` console script's
target) and any given with ``--entry-point GROUP:NAME=MODULE:ATTR`` (for example a benchmark's
plugin, which the wheel must not carry).

    python3 scripts/register_entry_points.py --target /tmp/site \\
        --entry-point vllm.general_plugins:loraplex_balanced_dummy=benchmarks.engine.gpt_oss_dummy:register
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIST_NAME = "loraplex-checkout"


def project_entry_points(pyproject: Path) -> dict[str, dict[str, str]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {group: dict(points) for group, points in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        groups["console_scripts"] = dict(project["scripts"])
    return groups


def parse_extra(values: list[str]) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    for value in values:
        group, _, point = value.partition(":")
        name, _, target = point.partition("=")
        if not (group and name and ":" in target):
            raise SystemExit(f"--entry-point wants GROUP:NAME=MODULE:ATTR, got {value!r}")
        groups.setdefault(group, {})[name] = target
    return groups


def write_dist_info(target: Path, groups: dict[str, dict[str, str]], name: str = DIST_NAME) -> Path:
    """``target/<name>-0.dist-info`` declaring ``groups``' entry points; returned.

    ``importlib.metadata`` keeps only the first distribution of a name on ``sys.path``, so a
    folder written for another purpose (a benchmark's plugin) must use a name of its own, or it
    hides the checkout's entry points wherever it comes first.
    """
    dist = target / f"{name.replace('-', '_')}-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    text = "".join(f"[{group}]\n" + "".join(f"{n} = {t}\n" for n, t in sorted(points.items()))
                   + "\n" for group, points in sorted(groups.items()))
    (dist / "entry_points.txt").write_text(text)
    (dist / "RECORD").write_text("")
    return dist


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, type=Path, help="site directory on sys.path")
    ap.add_argument("--entry-point", action="append", default=[],
                    help="GROUP:NAME=MODULE:ATTR, added to the project's own")
    args = ap.parse_args(argv)
    groups = project_entry_points(REPO / "pyproject.toml")
    for group, points in parse_extra(args.entry_point).items():
        groups.setdefault(group, {}).update(points)
    dist = write_dist_info(args.target, groups)
    print(f"entry points of {sum(map(len, groups.values()))} names written to {dist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
