"""Writing a finished ``torch.profiler`` profile as a gzip-compressed Chrome trace (the form
``benchmarks.profiling.trace_gaps`` and ``benchmarks.profiling.decode_timeline`` read)."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile


def write_trace_gz(prof, path: str) -> None:
    """``prof.export_chrome_trace`` into ``path`` (``.json.gz``), its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def trace_path(folder: str | None, kind: str, label: str) -> str | None:
    """``folder/<kind>_<label>.json.gz`` (spaces to underscores, commas dropped) for a column's
    trace; None when no folder was asked for."""
    if not folder:
        return None
    return os.path.join(folder, f"{kind}_{label.replace(' ', '_').replace(',', '')}.json.gz")
