"""``app.routing.autoscaling``: the demand planner's decisions, and the policy as Ray Serve loads
and calls it (Serve's own config model, policy resolution and context class)."""

from __future__ import annotations

import pytest

from app.routing.autoscaling import DemandPlanner, DemandSpec

PER = 16.0  # requests per replica


def _run(planner: DemandPlanner, demands: list[float], start: int = 2, period: float = 1.0) -> list[int]:
    current, out = start, []
    for i, d in enumerate(demands):
        current = planner.decide(i * period, d, current, PER, 1, 64)
        out.append(current)
    return out


def test_a_step_up_is_followed_at_once():
    p = DemandPlanner(DemandSpec(smooth_s=0.5, look_back_s=30, lead_s=0, downscale_delay_s=60))
    got = _run(p, [20.0] * 5 + [100.0] * 3)
    assert got[:5] == [2] * 5
    assert got[5] == 7  # ceil(100 / 16), the first tick that saw it


def test_a_rising_demand_is_provisioned_a_start_time_ahead():
    spec = DemandSpec(smooth_s=5, look_back_s=30, lead_s=30, downscale_delay_s=60)
    ramp = [16.0 + 0.8 * t for t in range(90)]  # +0.8 requests/s: +24 over the lead
    ahead = _run(DemandPlanner(spec), ramp)
    now = _run(DemandPlanner(spec.model_copy(update={"lead_s": 0})), ramp)
    assert ahead[-1] >= now[-1] + 1, (ahead[-10:], now[-10:])
    assert ahead[-1] == -(-(ramp[-3] + 0.8 * 30) // PER) or ahead[-1] == -(-(ramp[-1] + 0.8 * 30) // PER)
    # no slope before a whole look-back window: the first 30 ticks follow the level alone
    assert ahead[:30] == now[:30]


def test_scale_down_waits_for_the_whole_window_and_ignores_one_spike():
    spec = DemandSpec(smooth_s=5, look_back_s=10, lead_s=0, downscale_delay_s=20)
    p = DemandPlanner(spec)
    got = _run(p, [30.0] * 40, start=6)  # 2 replicas' worth, 6 running
    assert got[19] == 6 and got[-1] == 2, got  # not before 20 s of history
    first_down = got.index(2)
    assert 20 <= first_down <= 21, got
    # one noisy sample of 5 replicas' worth moves the 5 s level by a fifth of it: it neither
    # scales up past what that level needs nor holds the replicas for the window
    p = DemandPlanner(spec)
    got = _run(p, [30.0] * 30 + [80.0] + [30.0] * 30, start=2)
    assert max(got) <= 3 and got[-1] == 2, got


def test_bounds_and_bad_input():
    p = DemandPlanner(DemandSpec(smooth_s=1, lead_s=0))
    assert p.decide(0, 1000.0, 1, PER, 1, 4) == 4
    assert DemandPlanner().decide(0, 0.0, 3, PER, 2, 8) == 3  # no history: no scale-down yet
    with pytest.raises(ValueError, match="per_replica must be > 0"):
        DemandPlanner().decide(0, 1.0, 1, 0.0, 1, 4)


def test_ray_serve_loads_and_calls_the_policy():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    cfg = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=PER,
                            policy={"policy_function": "app.routing.autoscaling:DemandAutoscalingPolicy",
                                    "policy_kwargs": {"smooth_s": 1, "lead_s": 0, "downscale_delay_s": 5}})
    policy = _resolve_policy_callable(cfg.policy)
    state: dict = {"kept": True}

    def ctx(t: float, requests: float, target: int) -> AutoscalingContext:
        return AutoscalingContext(
            deployment_id=DeploymentID(name="EngineServer", app_name="loraplex"), deployment_name="EngineServer",
            app_name="loraplex", current_num_replicas=target, target_num_replicas=target, running_replicas=[],
            total_num_requests=requests, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics={},
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state=state,
            last_scale_up_time=None, last_scale_down_time=None, current_time=t, config=cfg)

    target, returned = policy(ctx(0.0, 50.0, 1))
    assert target == 4 and returned is state  # ceil(50 / 16), at once
    target, _ = policy(ctx(1.0, 200.0, 4))
    assert target == 8  # capped at max_replicas
    for t in range(2, 12):
        target, _ = policy(ctx(float(t), 10.0, target))
    assert target == 1
