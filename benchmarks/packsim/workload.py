"""Tenants' traffic: Zipf popularity, a diurnal swing, Poisson arrivals.

Tenant ``i`` (1-based) has peak load ``peak_tenant_load · i^-zipf_s`` replicas (a replica's
load unit: its output tokens/s with a full batch, ``Calibration.capacity_tokens_per_s``), scaled
over time by ``diurnal(t) = low + (1 - low) · (1 - cos(2πt / period)) / 2`` (trough at t = 0,
peak at half the period). Requests have fixed prompt and output lengths; arrivals are a
non-homogeneous Poisson process per tenant (thinning), reproducible from ``seed``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator

from pydantic import BaseModel, Field


class WorkloadSpec(BaseModel):
    tenants: int = Field(100, ge=1, description="Tenants, one adapter each.")
    zipf_s: float = Field(0.5, ge=0, description="Zipf exponent of the tenants' popularity (0: all equal).")
    peak_tenant_load: float = Field(0.10, gt=0, description="The most popular tenant's peak load, in replicas.")
    diurnal_low: float = Field(0.2, ge=0, le=1, description="Trough load as a fraction of the peak.")
    period_s: float = Field(7200, gt=0, description="Seconds of one diurnal cycle (compressed day).")
    duration_s: float = Field(7200, gt=0, description="Seconds simulated.")
    prompt_tokens: int = Field(64, ge=1, description="Prompt tokens of every request.")
    output_tokens: int = Field(128, ge=1, description="Output tokens of every request.")
    seed: int = Field(0, description="Arrivals' seed.")

    def tenant_peak_loads(self) -> list[float]:
        return [self.peak_tenant_load * (i + 1) ** -self.zipf_s for i in range(self.tenants)]

    def diurnal(self, t: float) -> float:
        return self.diurnal_low + (1 - self.diurnal_low) * (1 - math.cos(2 * math.pi * t / self.period_s)) / 2

    def total_load(self, t: float) -> float:
        """Σ load of all tenants at ``t``, in replicas."""
        return sum(self.tenant_peak_loads()) * self.diurnal(t)

    def mean_total_load(self, samples: int = 2000) -> float:
        return sum(self.total_load(self.duration_s * (k + 0.5) / samples) for k in range(samples)) / samples

    def mean_whole_replicas(self, min_replicas: int = 1, samples: int = 2000) -> float:
        """Time mean of ``max(min_replicas, ⌈Σ load(t)⌉)``: what an autoscaler that knew the load
        and had replicas at once would pay for, every replica at a full batch (no policy does
        better with whole replicas)."""
        return sum(max(min_replicas, math.ceil(self.total_load(self.duration_s * (k + 0.5) / samples) - 1e-9))
                   for k in range(samples)) / samples


def tenant_name(i: int) -> str:
    return f"t{i:03d}"


def arrivals(spec: WorkloadSpec, capacity_tokens_per_s: float) -> Iterator[tuple[float, str]]:
    """``(time, tenant)`` of every request, in time order."""
    rng = random.Random(spec.seed)
    per_request = spec.output_tokens / capacity_tokens_per_s  # replica-seconds of one request
    peaks = [load / per_request for load in spec.tenant_peak_loads()]  # requests/s at the peak
    heap = [(rng.expovariate(p), i) for i, p in enumerate(peaks)]
    heapq.heapify(heap)
    while heap:
        t, i = heapq.heappop(heap)
        if t >= spec.duration_s:
            continue
        if rng.random() < spec.diurnal(t):  # thinning: accepted with the current fraction of the peak
            yield t, tenant_name(i)
        heapq.heappush(heap, (t + rng.expovariate(peaks[i]), i))
