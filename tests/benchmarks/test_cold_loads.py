"""The cold-load profile (``benchmarks.profiling.cold_loads``): its gap window, and the whole
profile on the real CPU engine (the embedded model, a demo adapter through the replica's load path)."""

from __future__ import annotations

import pytest

from benchmarks.profiling.cold_loads import ColdLoadsReport, Load, run, summary, window_gaps


def test_gaps_are_those_ending_in_the_window_per_stream():
    arrivals = [(0.0, 0), (0.5, 1), (1.0, 0), (1.2, 1), (3.0, 0), (3.1, 1), (9.0, 0)]
    assert window_gaps(arrivals, 1.0, 3.5) == pytest.approx([1.0, 0.7, 2.0, 1.9])  # 9.0 is past the end


def test_summary_gives_the_median_per_mode():
    loads = [Load(mode=m, rep=r, add_lora_s=s, cold_ttft_ms=10 * s, warm_ttft_ms=1.0, gap_p50_ms=2.0,
                  gap_max_ms=g, gaps=5)
             for m, r, s, g in (("eager", 0, 1.0, 9.0), ("deferred", 0, 0.4, 30.0), ("eager", 1, 3.0, 7.0),
                                ("deferred", 1, 0.2, 50.0), ("eager", 2, 2.0, 8.0), ("deferred", 2, 0.3, 40.0))]
    text = summary(ColdLoadsReport(adapter="a", streams=2, prompt_len=8, loads=loads))
    assert "| eager | 3 | 2.000 | 20.0 | 1.0 | 2.0 | 8.0 |" in text
    assert "| deferred | 3 | 0.300 | 3.0 | 1.0 | 2.0 | 40.0 |" in text


def test_the_profile_runs_on_the_cpu_engine(embedded_model_dir, demo_adapter_sources, tmp_path):
    import asyncio

    from tests.helpers.stack import write_config

    config = write_config(tmp_path / "serve.yaml", 8000, {"engine": {"model": str(embedded_model_dir)}})
    adapter = next(iter(demo_adapter_sources.values()))
    report = asyncio.run(run(config, adapter, ["eager", "deferred", "pooled"], reps=1, streams=2, prompt_len=32,
                             settle_s=0.5, region_gib=0.25))
    assert [x.mode for x in report.loads] == ["eager", "deferred", "pooled"]
    assert report.region_bytes == 0  # a CPU engine page-locks nothing: no region, pooled loads defer
    for load in report.loads:
        assert load.add_lora_s > 0 and load.cold_ttft_ms > 0 and load.warm_ttft_ms > 0
        assert load.gaps > 0 and 0 < load.gap_p50_ms <= load.gap_max_ms  # the streams kept decoding meanwhile
    assert report.steady_gap_p50_ms > 0
