"""benchmarks/observability.py's first part in a real local Ray instance: the recording paths
are timed and what they recorded reaches the node's metrics export (else it raises)."""

from __future__ import annotations

import pytest


def test_metrics_path_costs_are_timed_and_exported():
    from benchmarks.observability import metrics_path_costs

    costs = metrics_path_costs(reps=200, tokens=8, label_sets=20)
    assert set(costs) == {"gateway_us", "gateway_logged_us", "engine_request_us", "engine_per_token_us",
                          "local_scrape_ms"}
    assert 0 < costs["gateway_us"] < costs["gateway_logged_us"]
    assert costs["engine_request_us"] > 0 and costs["engine_per_token_us"] == pytest.approx(costs["engine_request_us"] / 8)
    assert costs["local_scrape_ms"] > 0
