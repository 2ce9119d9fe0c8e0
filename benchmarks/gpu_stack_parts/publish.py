"""A run's report as it is committed under ``benchmarks/results/``: the reports of one machine
start merged in order (``benchmarks.gpu_stack.merge_reports``), per-request records dropped
(aggregates only), and no path of the host it ran on: the interpreter becomes ``python3``, the
checkout the current folder, each run's ``--workdir`` ``$GPU_STACK_WORKDIR``, its ``--out``
``$OUT/<name>``, a ``--merge`` file ``<earlier run>/gpu_stack.json``.

    python -m benchmarks.gpu_stack_parts.publish REPORT [REPORT ...] --json FILE [--plot PNG]
    python -m benchmarks.gpu_stack_parts.publish --paths-only FILE [FILE ...]   # committed files: paths, nothing else
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import tempfile
from pathlib import Path

from benchmarks.gpu_stack_parts.models import StackReport

RUN_SEPARATOR = " ; then "  # how merge_reports joins the runs' command lines
SCRIPT = "benchmarks/gpu_stack.py"


def host_paths(report: StackReport) -> dict[str, str]:
    """Host path -> its portable name, from every run's command line and every system's
    interpreter in ``report``."""
    names: dict[str, str] = {}
    for run in report.command.split(RUN_SEPARATOR):
        args = shlex.split(run)
        if not args:
            continue
        names[args[0]] = "python3"
        for arg in args[1:]:
            if arg.endswith("/" + SCRIPT):
                names[arg[:-len(SCRIPT)]] = ""
        for flag, name in (("--workdir", lambda v: "$GPU_STACK_WORKDIR"), ("--out", lambda v: f"$OUT/{Path(v).name}"),
                           ("--merge", lambda v: "<earlier run>/gpu_stack.json")):
            for i, arg in enumerate(args[:-1]):
                if arg == flag and args[i + 1].startswith("/"):
                    names[args[i + 1]] = name(args[i + 1])
    for system in report.systems:
        interpreter = (system.command or "").split(" ", 1)[0]
        if interpreter.startswith("/") and Path(interpreter).name.startswith("python"):
            names[interpreter] = "python3"
    return {path: name for path, name in names.items() if path.startswith("/")}


def portable(text: str, names: dict[str, str]) -> str:
    """``text`` with each path of ``names`` replaced by its name (longest first, so a folder
    inside another is named by its own role)."""
    for path, name in sorted(names.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    return text


def publishable(report: StackReport) -> StackReport:
    """``report`` without per-request records and with its ``host_paths`` named everywhere."""
    report = report.model_copy(deep=True)
    for system in report.systems:
        for phase in system.phases:
            phase.result.records = []
        for check in system.cross_checks:
            check.ours.records = []
    return StackReport.model_validate_json(portable(report.model_dump_json(indent=1), host_paths(report)))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu_stack import merge_reports
    from benchmarks.gpu_stack_parts.output import write_outputs
    from benchmarks.gpu_stack_parts.plan import rebuild_plan

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", type=Path, nargs="+", help="gpu_stack.json of each run, in the order they ran")
    ap.add_argument("--json", type=Path, help="where the published report goes")
    ap.add_argument("--plot", type=Path, help="where its plot goes")
    ap.add_argument("--paths-only", action="store_true",
                    help="rewrite each REPORT's host paths in place, its text otherwise unchanged")
    args = ap.parse_args(argv)
    if args.paths_only:
        for path in args.reports:
            text = path.read_text()
            path.write_text(portable(text, host_paths(StackReport.model_validate_json(text))))
        return 0
    if args.json is None:
        ap.error("--json is required unless --paths-only")
    report = StackReport.model_validate_json(args.reports[0].read_text())
    plan = rebuild_plan(report.plan, tuple(s.system for s in report.systems))
    for later in args.reports[1:]:
        report, plan = merge_reports(report, StackReport.model_validate_json(later.read_text()), None,
                                     report.plan["model"])
    report = publishable(report)
    with tempfile.TemporaryDirectory() as tmp:
        print(write_outputs(report, plan, Path(tmp)))
        if args.plot:
            shutil.copyfile(Path(tmp) / "gpu_stack.png", args.plot)
    args.json.write_text(report.model_dump_json(indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
