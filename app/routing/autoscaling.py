"""Demand autoscaling of engine replicas: replicas for the requests there are, and for the ones
the recent trend says will be there by the time a new replica is up.

Serve's default policy plans ``target_ongoing_requests`` per replica, adds replicas once more
have been wanted for ``upscale_delay_s`` and removes them once fewer have been wanted for
``downscale_delay_s``. An LLM engine replica takes tens of seconds to minutes to start, so on a
rising load the waiting adds to the start time and requests queue; on a falling one the long
delay keeps idle replicas paid for. ``DemandPlanner``:

- demand ``d``: requests in flight (at replicas and queued upstream, Serve's ``total_num_requests``);
- plan: the mean of ``d`` over the last ``smooth_s`` plus its slope over ``look_back_s`` times
  ``lead_s`` (a replica's start time), never below that mean (no slope until a whole
  ``look_back_s`` has been seen);
- up: at once, to ``ceil(plan / per_replica)``;
- down: to ``ceil(max level over the last downscale_delay_s / per_replica)`` when that is fewer
  (the level: the ``smooth_s`` mean, so one noisy sample neither keeps nor removes a replica):
  a replica goes only once the whole window's peak level fits without it.

``DemandAutoscalingPolicy`` is the same planner as a Ray Serve class-callable autoscaling policy
(``autoscaling_config.policy.policy_function: app.routing.autoscaling:DemandAutoscalingPolicy``,
``policy_kwargs`` the ``DemandSpec`` fields); ``per_replica`` is the deployment's
``target_ongoing_requests``. The packing simulation runs the planner itself.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from pydantic import BaseModel, Field


class DemandSpec(BaseModel):
    """How far the planner looks back and ahead."""

    smooth_s: float = Field(10.0, gt=0, description="Seconds of demand averaged for the current level.")
    look_back_s: float = Field(60.0, gt=0, description="Seconds of demand the slope is fitted over.")
    lead_s: float = Field(30.0, ge=0, description="Seconds ahead the plan provisions for: a replica's start time.")
    downscale_delay_s: float = Field(60.0, ge=0, description="A replica is removed once the peak demand of "
                                     "this many seconds fits in fewer.")


def _slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, d)`` samples (0 with fewer than two distinct times)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    md = sum(d for _, d in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var <= 0 else sum((t - mt) * (d - md) for t, d in samples) / var


class DemandPlanner:
    """``decide(now, demand, ...)`` once per control tick, times increasing."""

    def __init__(self, spec: DemandSpec | None = None) -> None:
        self.spec = spec or DemandSpec()
        self._samples: deque[tuple[float, float]] = deque()
        self._levels: deque[tuple[float, float]] = deque()  # (t, smooth_s mean at t)

    def decide(self, now: float, demand: float, current: int, per_replica: float, min_replicas: int,
               max_replicas: int) -> int:
        """The replica count to run now, within ``[min_replicas, max_replicas]``."""
        if per_replica <= 0:
            raise ValueError(f"per_replica must be > 0, got {per_replica}")
        s = self.spec
        self._samples.append((now, float(demand)))
        keep = max(s.look_back_s, s.downscale_delay_s, s.smooth_s)
        while self._samples and self._samples[0][0] < now - keep:
            self._samples.popleft()
        recent = [d for t, d in self._samples if t >= now - s.smooth_s]
        level = sum(recent) / len(recent)
        self._levels.append((now, level))
        while self._levels and self._levels[0][0] < now - s.downscale_delay_s:
            self._levels.popleft()
        window = [(t, d) for t, d in self._samples if t >= now - s.look_back_s]
        full = self._samples[0][0] <= now - s.look_back_s  # a slope of a partial window is a start-up artefact
        trend = _slope(window) if full else 0.0
        plan = max(level, level + trend * s.lead_s)
        want_up = math.ceil(plan / per_replica - 1e-9)
        peak = max(x for _, x in self._levels)
        want_down = math.ceil(peak / per_replica - 1e-9)
        target = current
        if want_up > current:
            target = want_up
        elif want_down < current and self._samples[0][0] <= now - s.downscale_delay_s:
            target = max(want_down, want_up)  # a window's history first: no scale-down on a fresh start
        return min(max_replicas, max(min_replicas, target))


class DemandAutoscalingPolicy:
    """Ray Serve class-callable autoscaling policy: ``policy(ctx) -> (replicas, policy_state)``."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.planner = DemandPlanner(DemandSpec(**policy_kwargs))

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        cfg = ctx.config
        target = self.planner.decide(now, ctx.total_num_requests, ctx.target_num_replicas,
                                     cfg.target_ongoing_requests, ctx.capacity_adjusted_min_replicas,
                                     ctx.capacity_adjusted_max_replicas)
        return target, ctx.policy_state
