"""Where a loraplex cold start goes, from the engine replica's request log: the cold request's
line (``app.logging_json.RequestLog``) carries the steps of the adapter load it waited for
(``adapter_load``: disk, checks, add_lora).

The stack's ``loraplex_adapter_load_seconds`` histogram is no source for one load's seconds: what
Ray's metrics export gives as a histogram's ``_sum`` is rebuilt from bucket midpoints (a load of
1.14 s reads 1.75 s, the middle of its bucket 1.0–2.5 s).
"""

from __future__ import annotations

import time
from pathlib import Path

from app.logging_json import RequestLog
from benchmarks.profiling.request_hops import request_log_records


def load_steps(log: Path, adapter: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The ``adapter_load`` of the last engine line for ``adapter`` that has one (the replica
    writes its line when the request ends, through a queue: it may lag a little), or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = None
        if log.exists():
            for raw in request_log_records(log):
                if raw.get("component") != "engine" or raw.get("adapter") != adapter:
                    continue
                try:
                    rec = RequestLog.model_validate(raw)
                except ValueError:
                    continue
                if rec.adapter_load:
                    found = rec.adapter_load
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
