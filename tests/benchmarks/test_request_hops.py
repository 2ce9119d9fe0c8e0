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


def test_bursts_are_measured_as_sent_at_the_gateway_and_at_the_engine(tmp_path):
    """A phase of two bursts of 4 that the client sent within 10 ms each; the gateway took each
    over 20 ms and the engine replica over 40 ms; stragglers are not bursts."""
    from benchmarks.profiling.request_hops import burst_spreads, spreads_table

    lines, records = [], []
    for b in range(2):
        for i in range(4):
            t = 100.0 + 10 * b  # the gateway takes request i at t + 20 ms * i / 3, the engine at t + 40 ms * i / 3
            gw = RequestLog(ts=t + 1.0, component="gateway", request_id=f"b{b}-{i}", status=200, queue_s=0.001,
                            duration_s=1.0 - 0.020 * i / 3)
            en = RequestLog(ts=t + 1.0, component="engine", request_id=f"b{b}-{i}", status=200,
                            duration_s=1.0 - 0.040 * i / 3, ttft_s=0.05)
            lines += [gw.model_dump_json(exclude_none=True), en.model_dump_json(exclude_none=True)]
            records.append({"ttft_ms": 60.0, "start_s": 10 * b + 0.01 * i / 3})
    log = tmp_path / "loraplex.log"
    log.write_text("\n".join(lines) + "\n")
    system = {"system": "loraplex", "phases": [{"name": "c4", "result": {"records": records}}]}
    row = next(r for r in spreads_table(read_hops(log), system).splitlines() if r.startswith("| c4 "))
    assert [c.strip() for c in row.strip("|").split("|")] == ["c4", "2", "10.0", "20.0", "40.0"]
    assert burst_spreads([0.0, 0.1, 0.2, 5.0, 5.1]) == [] and burst_spreads([0.0, 0.1, 0.2, 0.3, None]) == [0.3]
