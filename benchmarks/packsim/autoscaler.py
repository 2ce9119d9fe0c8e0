"""Ray Serve 2.60's default autoscaling policy (``replica_queue_length_autoscaling_policy``), as
the simulation's control loop runs it.

Every ``control_period_s`` the total requests (at replicas and waiting upstream), averaged over
``look_back_period_s``, give ``desired = total / target_ongoing_requests`` (scaling factor 1,
rounded up, within [min, max]); a change happens once it has been wanted without interruption
for ``upscale_delay_s`` (up) or ``downscale_delay_s`` (down).
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import BaseModel, Field


class AutoscaleSpec(BaseModel):
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(64, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0, description="None: the engine's batch capacity.")
    look_back_period_s: float = Field(30.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    control_period_s: float = Field(1.0, gt=0)


class Autoscaler:
    def __init__(self, spec: AutoscaleSpec, target_ongoing: float) -> None:
        self.spec = spec
        self.target_ongoing = spec.target_ongoing_requests or target_ongoing
        self._samples: deque[tuple[float, int]] = deque()
        self._wanted: tuple[int, float] | None = None  # (direction, since)

    def decide(self, now: float, total_requests: int, current_target: int) -> int:
        """The target replica count after this control tick."""
        self._samples.append((now, total_requests))
        while self._samples and self._samples[0][0] < now - self.spec.look_back_period_s:
            self._samples.popleft()
        avg = sum(n for _, n in self._samples) / len(self._samples)
        desired = min(self.spec.max_replicas, max(self.spec.min_replicas, math.ceil(avg / self.target_ongoing - 1e-9)))
        if desired == current_target:
            self._wanted = None
            return current_target
        direction = 1 if desired > current_target else -1
        if self._wanted is None or self._wanted[0] != direction:
            self._wanted = (direction, now)
        delay = self.spec.upscale_delay_s if direction > 0 else self.spec.downscale_delay_s
        if now - self._wanted[1] + 1e-9 >= delay:
            self._wanted = None
            return desired
        return current_target
