"""The per-hop TTFT profile of a gpu_stack run: request log lines (as the gateway and the engine
replica write them) matched to the report's phases by order, warm-ups and probes left out."""

from __future__ import annotations

from app.logging_json import RequestLog
from benchmarks.profiling.request_hops import loads_table, read_hops, table


def _lines(rid: str, t0: float, queue: float, to_engine: float, ttft: float, load: dict | None = None) -> list[str]:
    gw = RequestLog(ts=t0 + 1.0, component="gateway", request_id=rid, status=200, queue_s=queue, duration_s=1.0)
    en = RequestLog(ts=t0 + 1.0, component="engine", request_id=rid, status=200, duration_s=1.0 - queue,
                    ttft_s=ttft, to_engine_s=to_engine, engine_queue_s=0.002, prefill_s=ttft - to_engine - 0.002,
                    adapter=rid, adapter_load=load)
    return [f"(ServeReplica pid=1) {gw.model_dump_json(exclude_none=True)}",
            f"(ServeReplica pid=1) {en.model_dump_json(exclude_none=True)}"]


def test_phases_are_matched_from_the_end_of_the_log(tmp_path):
    lines = ["INFO starting", "not json {\"ts\": broken"]
    t = 100.0
    for i in range(3):  # probes before the phases
        lines += _lines(f"probe-{i}", t, 0.9, 0.9, 0.9)
        t += 1
    for i in range(2):  # warm-up of phase "c1": dropped
        lines += _lines(f"warm-{i}", t, 0.5, 0.5, 0.5)
        t += 1
    for i in range(3):  # measured
        lines += _lines(f"c1-{i}", t, 0.001 * (i + 1), 0.0005, 0.060)
        t += 1
    load = {"disk_s": 0.75, "checks_s": 0.01, "add_lora_s": 0.2}
    lines += _lines("cold", t, 0.009, 1.0, 1.1, load) + _lines("warm", t + 1, 0.001, 0.0004, 0.05)
    log = tmp_path / "loraplex.log"
    log.write_text("\n".join(lines) + "\n")
    system = {"system": "loraplex", "cold_starts": [{}],
              "phases": [{"name": "c1", "warmup_requests": 2,
                          "result": {"records": [{"ttft_ms": 70.0}, {"ttft_ms": 68.0}, {"ttft_ms": 72.0}]}}]}
    hops = read_hops(log)
    assert len(hops) == 3 + 2 + 3 + 2
    text = table(hops, system)
    row = next(r for r in text.splitlines() if r.startswith("| c1 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # requests, client TTFT, gateway queue, to engine, engine queue, prefill, replica TTFT, rest
    assert cells[1:] == ["3", "70.0", "2.0", "0.5", "2.0", "57.5", "60.0", "8.0"]
    loads = loads_table(hops).splitlines()
    assert loads[2:] == ["| cold | 750.0 | 10.0 | 200.0 | 1000.0 | 1100.0 |", "(ms)"]
