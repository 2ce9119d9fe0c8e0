"""Where a served request's time to first token goes, per phase of a ``benchmarks.gpu_stack`` run:
the gateway's and the engine replica's request log lines (``app.logging_json.RequestLog``, joined
by request id) read beside the phases of the run's report.

Per measured request: ``gateway queue`` (arrival at the gateway to dispatch: tenant, catalog,
admission, fair-share queue), ``to engine`` (arrival at the engine replica to vLLM's engine taking
it: adapter resident, body parsed, vLLM's serving layer), ``engine queue`` (vLLM's scheduler queue
to first scheduled), ``prefill`` (first scheduled to the first token) and the replica's TTFT; the
client's TTFT from the report beside them. What the client saw beyond the gateway queue plus the
replica's TTFT is the HTTP path outside both (proxy, ASGI, the first chunk's relay). Then, per
phase, how spread out its bursts of requests were (first to last of requests started within
``BURST_S`` of a burst's first) as the client sent them, as the gateway took them and as the
engine replica took them: a path that handles a burst's requests one after another stretches it.
Then every request that waited for its adapter's load, with the load's steps.

Lines are matched to phases by order: the run sends its phases one after another (each phase's
warm-up requests first, then its measured ones), then its cold starts (two requests each); the
lines before them (readiness probes, the shape sweep) are skipped.

    python -m benchmarks.profiling.request_hops LOG REPORT [--system loraplex]

``LOG``: the loraplex server log (``loraplex/loraplex.log`` of the run's ``server-logs.tgz``);
``REPORT``: the run's ``gpu_stack.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field

COLD_START_REQUESTS = 2  # the cold request and the warm one after it
BURST_S = 0.5  # requests started within this of a burst's first belong to that burst
MIN_BURST = 4  # smaller groups are not bursts


class Hop(BaseModel):
    """One request's TTFT parts, seconds (None: not logged)."""

    started: float = Field(description="Unix time the gateway took the request.")
    engine_started: float | None = Field(None, description="Unix time the engine replica took it.")
    gateway_queue: float | None
    to_engine: float | None
    engine_queue: float | None
    prefill: float | None
    engine_ttft: float | None
    adapter: str | None = None
    adapter_load: dict[str, float] | None = Field(None, description="The adapter load the request waited for.")


def request_log_records(log: Path) -> Iterator[dict]:
    """The request log lines of a server log (``app.logging_json.RequestLog`` as JSON, after
    whatever prefix Ray put before them), in file order; other lines are passed over."""
    with log.open(errors="replace") as f:
        for line in f:
            at = line.find('{"ts"')
            if at < 0:
                continue
            try:
                yield json.loads(line[at:])
            except ValueError:
                continue


def read_hops(log: Path) -> list[Hop]:
    """Requests with both a gateway and an engine line, in the order the gateway took them."""
    lines: dict[str, dict[str, dict]] = {}
    for rec in request_log_records(log):
        if rec.get("component") in ("gateway", "engine") and rec.get("request_id"):
            lines.setdefault(rec["request_id"], {})[rec["component"]] = rec
    hops = []
    for pair in lines.values():
        gw, en = pair.get("gateway"), pair.get("engine")
        if gw is None or en is None:
            continue
        engine_started = en["ts"] - en["duration_s"] if en.get("duration_s") is not None else None
        hops.append(Hop(started=gw["ts"] - (gw.get("duration_s") or 0.0), engine_started=engine_started,
                        gateway_queue=gw.get("queue_s"),
                        to_engine=en.get("to_engine_s"), engine_queue=en.get("engine_queue_s"),
                        prefill=en.get("prefill_s"), engine_ttft=en.get("ttft_s"), adapter=en.get("adapter"),
                        adapter_load=en.get("adapter_load")))
    return sorted(hops, key=lambda h: h.started)


def phase_slices(system: dict, total: int) -> list[tuple[str, slice, list[dict]]]:
    """``(phase, its measured requests' slice of the hops, the client's records)``, aligned from
    the end of the log (cold starts last)."""
    end = total - COLD_START_REQUESTS * len(system.get("cold_starts") or [])
    out = []
    for phase in reversed(system.get("phases") or []):
        result = phase.get("result") or {}
        records = result.get("records") or []
        measured = slice(end - len(records), end)
        out.append((phase["name"], measured, records))
        end = measured.start - (phase.get("warmup_requests") or 0)
    if end < 0:
        raise SystemExit(f"the log has {total} requests, fewer than the report's phases sent")
    return out[::-1]


def p50_ms(values) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept) * 1e3, 1) if kept else None


def table(hops: list[Hop], system: dict) -> str:
    head = ("| phase | requests | client TTFT | gateway queue | to engine | engine queue | prefill | replica TTFT | "
            "client − (gateway queue + replica TTFT) |\n|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for name, measured, records in phase_slices(system, len(hops)):
        part = hops[measured]
        client = [r["ttft_ms"] for r in records if r.get("ttft_ms") is not None]
        client_p50 = round(statistics.median(client), 1) if client else None
        q, ttft = p50_ms(h.gateway_queue for h in part), p50_ms(h.engine_ttft for h in part)
        outside = round(client_p50 - q - ttft, 1) if None not in (client_p50, q, ttft) else None
        cells = [client_p50, q, p50_ms(h.to_engine for h in part), p50_ms(h.engine_queue for h in part),
                 p50_ms(h.prefill for h in part), ttft, outside]
        rows.append(f"| {name} | {len(part)} | " + " | ".join("–" if c is None else f"{c}" for c in cells) + " |")
    return "\n".join(rows) + "\n(p50 of each column over the phase's measured requests, ms)"


def burst_spreads(starts) -> list[float]:
    """Seconds from the first to the last start of each burst (``BURST_S``, ``MIN_BURST``)."""
    bursts: list[list[float]] = []
    for s in sorted(s for s in starts if s is not None):
        if bursts and s - bursts[-1][0] <= BURST_S:
            bursts[-1].append(s)
        else:
            bursts.append([s])
    return [b[-1] - b[0] for b in bursts if len(b) >= MIN_BURST]


def spreads_table(hops: list[Hop], system: dict) -> str:
    """Per phase, the median burst spread as sent, at the gateway and at the engine replica."""
    rows = ["| phase | bursts | as the client sent them | as the gateway took them | as the engine replica took them |",
            "|---|---|---|---|---|"]
    for name, measured, records in phase_slices(system, len(hops)):
        part = hops[measured]
        sides = [burst_spreads(r.get("start_s") for r in records), burst_spreads(h.started for h in part),
                 burst_spreads(h.engine_started for h in part)]
        if not sides[0]:
            continue
        cells = [p50_ms(side) for side in sides]
        rows.append(f"| {name} | {len(sides[0])} | " + " | ".join("–" if c is None else f"{c}" for c in cells) + " |")
    note = (f"(median over a phase's bursts of first-to-last start, ms; a burst: {MIN_BURST}+ requests "
            f"within {BURST_S} s)")
    return "\n".join(rows) + "\n" + note if len(rows) > 2 else "(no phase sent bursts)"


def loads_table(hops: list[Hop]) -> str:
    """Every request that waited for its adapter's load (first uses, cold starts), in order."""
    rows = ["| adapter | disk (download, verify) | checks | add_lora | to engine | replica TTFT |",
            "|---|---|---|---|---|---|"]
    for h in hops:
        if h.adapter_load:
            cells = [h.adapter_load.get("disk_s"), h.adapter_load.get("checks_s"), h.adapter_load.get("add_lora_s"),
                     h.to_engine, h.engine_ttft]
            text = ("–" if c is None else f"{c * 1e3:.1f}" for c in cells)
            rows.append(f"| {h.adapter} | " + " | ".join(text) + " |")
    return "\n".join(rows) + "\n(ms)" if len(rows) > 2 else "(no request waited for an adapter load)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="loraplex server log with the request log lines")
    ap.add_argument("report", type=Path, help="the run's gpu_stack.json")
    ap.add_argument("--system", default="loraplex")
    args = ap.parse_args(argv)
    report = json.loads(args.report.read_text())
    system = next((s for s in report["systems"] if s["system"] == args.system), None)
    if system is None:
        raise SystemExit(f"{args.system} is not in {args.report}")
    hops = read_hops(args.log)
    print(table(hops, system))
    print()
    print(spreads_table(hops, system))
    print()
    print(loads_table(hops))


if __name__ == "__main__":
    main()
