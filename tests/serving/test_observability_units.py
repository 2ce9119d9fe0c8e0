"""The pieces of app.observability that need no stack: token timing, label caps, request ids,
error bodies with ids, the local metrics backend and request log records."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.observability.token_timing import OutputProgress, TokenClock


def _progress(generated, first_ts=0.0, last_ts=0.0, tokens=0, cumulative=False, prompt=None, first_wall=None):
    return OutputProgress(prompt_tokens=prompt, output_tokens=tokens, cumulative=cumulative, generated=generated,
                          first_token_wall=first_wall, first_token_ts=first_ts, last_token_ts=last_ts)


def test_streamed_tokens_give_one_sample_per_interval(seed):
    rng = random.Random(seed)
    clock = TokenClock(started_wall=100.0)
    assert clock.update(_progress(0, prompt=7)).ttft is None  # queued: nothing yet
    stamps = [5.0]
    for _ in range(20):
        stamps.append(stamps[-1] + rng.uniform(0.001, 0.05))
    steps = [clock.update(_progress(i + 1, stamps[0], t, tokens=1, first_wall=100.25)) for i, t in enumerate(stamps)]
    assert steps[0].ttft == pytest.approx(0.25) and all(s.ttft is None for s in steps[1:])
    samples = [s.itl for s in steps for _ in range(s.itl_count)]
    assert samples == pytest.approx([b - a for a, b in zip(stamps, stamps[1:])])
    assert (clock.prompt_tokens, clock.output_tokens) == (7, 21)


def test_outputs_carrying_several_tokens_count_each_at_their_mean_interval():
    clock = TokenClock(started_wall=0.0)
    first = clock.update(_progress(3, 10.0, 10.4, tokens=3, first_wall=0.5))  # merged: tokens 1-3
    assert (first.ttft, first.itl_count) == (0.5, 2) and first.itl == pytest.approx(0.2)
    rest = clock.update(_progress(7, 10.0, 11.2, tokens=4))
    assert rest.itl_count == 4 and rest.itl == pytest.approx(0.2)
    assert clock.output_tokens == 7


def test_a_final_only_output_gives_the_requests_mean_interval_n_minus_1_times():
    clock = TokenClock(started_wall=50.0)
    step = clock.update(_progress(9, 2.0, 3.6, tokens=9, cumulative=True, prompt=4, first_wall=50.1))
    assert step.ttft == pytest.approx(0.1) and step.itl_count == 8 and step.itl * 8 == pytest.approx(1.6)
    again = clock.update(_progress(9, 2.0, 3.6, tokens=9, cumulative=True))
    assert again.itl_count == 0 and clock.output_tokens == 9  # cumulative counts are not added twice


def test_the_first_token_splits_ttft_into_engine_arrival_queue_and_prefill():
    clock = TokenClock(started_wall=100.0)
    clock.update(OutputProgress(prompt_tokens=4, output_tokens=1, cumulative=False, generated=1,
                                first_token_wall=100.3, first_token_ts=7.25, last_token_ts=7.25,
                                arrival_wall=100.02, queued_ts=7.0, scheduled_ts=7.05))
    assert clock.to_engine_s == pytest.approx(0.02)
    assert clock.engine_queue_s == pytest.approx(0.05) and clock.prefill_s == pytest.approx(0.2)
    later = TokenClock(started_wall=0.0)  # vLLM without the scheduler's timestamps: only TTFT
    later.update(_progress(1, 3.0, 3.0, tokens=1, first_wall=0.5))
    assert (later.to_engine_s, later.engine_queue_s, later.prefill_s) == (None, None, None)


def test_label_caps_keep_the_first_names_and_count_the_rest_as_other():
    from app.observability.config import ObservabilityConfig
    from app.observability.labels import OTHER, UNKNOWN, Labels

    labels = Labels(ObservabilityConfig(max_tenant_labels=2, max_adapter_labels=1))
    assert [labels.tenant(t) for t in ("a", "b", "c", "a", UNKNOWN)] == ["a", "b", OTHER, "a", UNKNOWN]
    assert [labels.adapter(x) for x in ("x", "y", "x")] == ["x", OTHER, "x"]


def test_request_ids_are_the_clients_when_usable():
    from app import request_ids

    assert request_ids.accept("abc-123_x.Y:z") == "abc-123_x.Y:z"
    for bad in (None, "", "has space", "x" * 129, "caf\u00e9"):
        made = request_ids.accept(bad)
        assert made != bad and len(made) == 32
    assert request_ids.current() is None
    token = request_ids.bind("rid-1")
    try:
        from app.errors import NotFound, error_response

        body = json.loads(error_response(NotFound("gone")).body)
        assert body["error"] == {"message": "gone", "type": "not_found_error", "code": 404, "request_id": "rid-1"}
    finally:
        request_ids.unbind(token)
    assert "request_id" not in json.loads(error_response(NotFound("gone")).body)["error"]


def test_gateway_outcome_is_recorded_once_in_the_local_registry_outside_ray():
    from prometheus_client import generate_latest

    from app.observability.config import ObservabilityConfig
    from app.observability.gateway import GatewayRecorder
    from app.observability.instruments import LOCAL

    rec = GatewayRecorder(ObservabilityConfig(request_logs=False))
    req = rec.request("chat", "rid-units")
    req.tenant, req.adapter = "unit-tenant", "unit-adapter"
    req.dispatched()
    req.finish(200)
    req.finish(500)  # ignored: the outcome is recorded once
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(LOCAL).decode())}
    (count,) = [s.value for s in families["loraplex_requests"].samples
                if s.name == "loraplex_requests_total" and s.labels["tenant"] == "unit-tenant"]
    assert count == 1
    statuses = {s.labels["status"] for s in families["loraplex_requests"].samples if s.labels.get("tenant") == "unit-tenant"}
    assert statuses == {"200"}
    queue = [s for s in families["loraplex_gateway_queue_seconds"].samples
             if s.name.endswith("_count") and s.labels["tenant"] == "unit-tenant"]
    assert [s.value for s in queue] == [1]


def test_request_log_records_carry_no_prompt_or_key_fields():
    from app.logging_json import RequestLog

    fields = set(RequestLog.model_fields)
    assert not fields & {"prompt", "messages", "body", "authorization", "api_key", "key", "headers", "output"}
    line = RequestLog(component="gateway", request_id="r", status=200).model_dump_json(exclude_none=True)
    assert set(json.loads(line)) == {"ts", "component", "request_id", "status"}


def test_residency_gauges_drop_to_zero_after_eviction_and_survive_a_refresh():
    from prometheus_client import generate_latest

    from app.observability.config import ObservabilityConfig
    from app.observability.instruments import LOCAL
    from app.observability.labels import Labels
    from app.observability.registry_metrics import ReplicaRegistryMetrics

    def resident() -> dict[str, float]:
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(LOCAL).decode())}
        return {s.labels["adapter"]: s.value for s in fams["loraplex_adapters_resident"].samples
                if s.labels["replica"] == "unit-replica"}

    obs = ReplicaRegistryMetrics(Labels(ObservabilityConfig(max_adapter_labels=2)), "unit-replica")
    obs.residency(["x", "x", "y", "z"], 4)  # two versions of x; z is past the cap
    assert resident() == {"x": 2, "y": 1, "other": 1}
    obs.residency(["y"], 4)
    assert resident() == {"x": 0, "y": 1, "other": 0}
    obs.refresh()
    assert resident() == {"x": 0, "y": 1, "other": 0}


def test_request_log_lines_reach_the_process_stderr_when_sys_stderr_is_redirected():
    """Serve's throughput-optimized mode replaces a replica's ``sys.stderr`` with a writer into its
    file logger; the request log lines must still go to the worker's own stderr (which Ray
    forwards to ``serve run``'s output), not into that logger."""
    import subprocess
    import sys

    code = (
        "import io, sys, time\n"
        "sys.stderr = io.StringIO()  # as Serve's StreamToLogger\n"
        "from app.logging_json import RequestLog, emit\n"
        "emit(RequestLog(component='gateway', request_id='rid-stderr', kind='chat', status=200, "
        "duration_s=0.001))\n"
        "time.sleep(0.5)\n"
        "assert 'rid-stderr' not in sys.stderr.getvalue()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "rid-stderr" in ln]
    assert json.loads(line)["request_id"] == "rid-stderr"
