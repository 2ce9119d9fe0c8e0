"""What one engine replica measured: the numbers the packing simulation is calibrated from.

``benchmarks.packsim.measure`` writes one (JSON) from a real engine; ``Calibration.load`` reads
it. Step times are interpolated linearly between the batch sizes measured (and extrapolated from
the last two above them).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, Field


def _interpolate(pts: tuple[tuple[int, float], ...], batch: int) -> float:
    b = max(1, batch)
    if b <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (b - b1) / (b1 - b0)


@lru_cache(maxsize=16)
def _step_table(pts: tuple[tuple[int, float], ...], n: int) -> list[float]:
    return [_interpolate(pts, b) for b in range(n + 1)]


class Calibration(BaseModel):
    """Measured figures of one engine replica and where they come from."""

    source: str = Field(description="How they were measured: command, date, host, versions.")
    batch_capacity: int = Field(ge=1, description="max_num_seqs of the engine measured: sequences per step.")
    adapter_slots: int = Field(ge=1, description="Adapters the replica holds registered (max_cpu_loras).")
    step_ms: dict[int, float] = Field(description="Decode step time at each batch size measured, ms.")
    prefill_ms_per_token: float = Field(ge=0, description="Extra first-token time per prompt token, ms.")
    first_token_ms: float = Field(ge=0, description="TTFT of one short request on an idle replica (engine only), ms.")
    adapter_load_ms: float = Field(ge=0, description="Extra TTFT of a request whose adapter was not registered, ms.")
    adapter_stall_ms: float = Field(ge=0, description="How long a load stalls the replica's other sequences, ms.")
    replica_start_s: float = Field(ge=0, description="Seconds from starting an engine replica to its first answer.")
    path_overhead_ms: float = Field(0.0, ge=0, description="TTFT the HTTP path adds over the engine (proxy, gateway, hops), ms.")
    path_overhead_source: str = Field("", description="Where path_overhead_ms comes from.")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        return cls.model_validate(json.loads(Path(path).read_text()))

    def step(self, batch: int) -> float:
        """Decode step time in ms with ``batch`` sequences (>= 1)."""
        table = _step_table(tuple(sorted(self.step_ms.items())), 4 * self.batch_capacity)
        return table[batch] if 0 <= batch < len(table) else _interpolate(tuple(sorted(self.step_ms.items())), batch)

    @property
    def capacity_tokens_per_s(self) -> float:
        """Output tokens/s of one replica with a full batch: the unit of load."""
        return self.batch_capacity * 1000.0 / self.step(self.batch_capacity)
