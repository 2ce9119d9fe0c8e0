"""The burst-spread benchmark (``benchmarks.loadgen.burst_spread``) at its tiniest: both clients
run their closed loop against the stand-in server, every wave but the first is measured."""

from __future__ import annotations

import json

from benchmarks.loadgen.burst_spread import CLIENTS, main


def test_both_clients_run_and_every_later_wave_is_measured(tmp_path, capsys):
    out = tmp_path / "spread.json"
    main(["--concurrency", "4", "--waves", "3", "--input-len", "16", "--chunks", "3", "--chunk-ms", "1",
          "--reps", "1", "--json", str(out)])
    runs = json.loads(out.read_text())
    assert set(runs) == set(CLIENTS)
    for client in CLIENTS:
        run = runs[client][0]
        assert run["waves"] == 2 and 0 <= run["wave_spread_ms_p50"] <= run["wave_spread_ms_max"]
        assert run["client_cpu_ms_per_request"] > 0
    assert "wave spread p50 ms" in capsys.readouterr().out
