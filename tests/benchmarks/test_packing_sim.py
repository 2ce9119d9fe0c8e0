"""The packing simulation's model on small workloads: what it must get right for its figures to
mean anything (requests conserved, capacity as calibrated, slots and batches honoured, the
policies behaving as their routers do)."""

from __future__ import annotations

import pytest

from benchmarks.packsim.autoscaler import AutoscaleSpec
from benchmarks.packsim.calibration import Calibration
from benchmarks.packsim.simulate import simulate
from benchmarks.packsim.workload import WorkloadSpec, arrivals

CAL = Calibration(source="test figures", batch_capacity=8, adapter_slots=4, step_ms={1: 4.0, 8: 8.0},
                  prefill_ms_per_token=0.0, first_token_ms=10.0, adapter_load_ms=50.0, adapter_stall_ms=5.0,
                  replica_start_s=20.0, path_overhead_ms=0.0)
# Serve's target_ongoing_requests below a full batch: at exactly a full batch per replica the
# replicas run at utilisation 1, a backlog builds while new ones start and the autoscaler overshoots.
AUTOSCALE = AutoscaleSpec(target_ongoing_requests=0.75 * CAL.batch_capacity)


def small(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"tenants": 20, "zipf_s": 0.0, "peak_tenant_load": 0.1, "diurnal_low": 1.0,
                           "period_s": 600, "duration_s": 600, "output_tokens": 32, **kw})


def test_step_times_interpolate_and_capacity_is_a_full_batch():
    assert CAL.step(1) == 4.0 and CAL.step(8) == 8.0 and CAL.step(4) == pytest.approx(4 + 4 * 3 / 7)
    assert CAL.step(16) == pytest.approx(8 + 4 * 8 / 7)  # extrapolated from the last two
    assert CAL.capacity_tokens_per_s == pytest.approx(1000.0)


def test_arrivals_carry_the_load_asked_for():
    wl = small()
    n = sum(1 for _ in arrivals(wl, CAL.capacity_tokens_per_s))
    expected = wl.total_load(0) * CAL.capacity_tokens_per_s / wl.output_tokens * wl.duration_s  # 2 replicas' worth
    assert abs(n - expected) < 4 * expected**0.5


@pytest.mark.parametrize("policy", ["loraplex-demand", "loraplex", "serve-default", "one-per-tenant"])
def test_every_request_is_served_once_and_no_faster_than_the_engine(policy):
    r = simulate(small(), CAL, policy, adapter_slots=4, max_loras=4)
    assert r.completed + r.failed == r.requests > 0
    assert r.ttft_ms.p50 >= CAL.first_token_ms - 1e-6
    if policy == "one-per-tenant":
        assert r.mean_replicas == pytest.approx(20) and r.adapter_loads == 20


@pytest.mark.parametrize("policy", ["loraplex", "loraplex-demand"])
def test_pooling_needs_about_the_load_and_far_fewer_replicas_than_one_per_tenant(policy):
    wl = small()
    pooled, dedicated = simulate(wl, CAL, policy, AUTOSCALE, adapter_slots=8), simulate(wl, CAL, "one-per-tenant")
    assert wl.mean_total_load() == pytest.approx(2.0)
    assert pooled.mean_replicas < dedicated.mean_replicas / 4
    assert pooled.mean_replicas >= 0.95 * wl.mean_total_load()  # nothing serves faster than its capacity


def test_the_whole_replica_floor_rounds_the_load_up_at_every_instant():
    steady = small()  # Σ load 2.0 all the time
    assert steady.mean_whole_replicas() == pytest.approx(2.0)
    swing = small(diurnal_low=0.2, peak_tenant_load=0.05)  # Σ load from 0.2 to 1.0: one replica, always
    assert swing.mean_whole_replicas() == pytest.approx(1.0) and swing.mean_total_load() == pytest.approx(0.6, abs=0.01)
    assert swing.mean_whole_replicas(min_replicas=2) == pytest.approx(2.0)
    # from 1.0 to 5.0 (cosine): ⌈Σ load⌉ steps through 1..5; above its mean, below the mean + 1
    wide = small(diurnal_low=0.2, peak_tenant_load=0.25)
    assert wide.mean_total_load() < wide.mean_whole_replicas() < wide.mean_total_load() + 1
    r = simulate(wide, CAL, "loraplex", AUTOSCALE, adapter_slots=8)
    assert r.floor_replicas == pytest.approx(wide.mean_whole_replicas())
    assert r.mean_replicas >= 0.95 * r.floor_replicas  # no policy beats the floor (5 %: arrivals are random)


def test_no_ttft_cliff_when_the_working_set_exceeds_the_slots():
    """40 adapters over replicas of 4 slots each: loraplex's router loads where a slot is free or
    evictable and never makes a request wait seconds; Serve's default router waits up to its
    matching timeout for a replica holding the adapter, and its queues grow past a second."""
    wl = small(tenants=40, peak_tenant_load=0.05, period_s=300, duration_s=300)
    ours = simulate(wl, CAL, "loraplex", AUTOSCALE, adapter_slots=4, max_loras=4)
    serve = simulate(wl, CAL, "serve-default", AUTOSCALE, adapter_slots=4, max_loras=4)
    assert ours.failed == 0 and ours.over_1s == 0, (ours.ttft_max_ms, ours.over_1s)
    assert serve.over_1s > 0.01, serve.over_1s


def test_the_same_seed_gives_the_same_run():
    a, b = (simulate(small(seed=3), CAL, "loraplex") for _ in range(2))
    assert a.model_dump() == b.model_dump()
