"""Host time and device span of each model forward of an in-process vLLM 0.24 engine.

An eager step (more tokens than the CUDA graphs hold) is host-bound when the GPU waits for the
launches: the forward's device span (CUDA events around it) then equals the host's time to
issue it, and kernel time is only part of it. ``ForwardTimer`` wraps the model runner's
``_model_forward`` (the forward alone) and ``execute_model`` (the whole step on the worker:
input preparation, LoRA mapping, forward, sampling) while active and records, per call, the
tokens, the host milliseconds and, for the forward, the device milliseconds between events
recorded on the current stream before and after it. Nothing waits for the GPU inside the
timed calls; the events are read when the timer closes.

Needs the engine core in this process (``benchmarks.engine.gpt_oss_dummy.in_process_engine_env``).
Without CUDA (vLLM-CPU, whose runner is a subclass of the GPU one) the forward runs
synchronously on the host and its device time is its host time. The one place that touches
vLLM's model runner: checked against vLLM 0.24 (GPU) and vLLM-CPU 0.32 (tests).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass
class ForwardRecord:
    """One forward: ``tokens`` (its padded input rows), ``host_ms`` to issue it, ``device_ms``
    between the events before and after it; ``step_host_ms`` of the ``execute_model`` call it
    ran in (0 if none was timed)."""

    tokens: int
    host_ms: float
    device_ms: float
    step_host_ms: float = 0.0


class ForwardTimer:
    """``with ForwardTimer() as t: ...`` — ``t.records`` (``ForwardRecord``) once closed."""

    def __init__(self) -> None:
        self.records: list[ForwardRecord] = []
        self._raw: list[list] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "ForwardTimer":
        import torch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from kernels.vllm.versions import require_any

        require_any("ForwardTimer (it wraps vLLM's model runner)")
        cuda = torch.cuda.is_available()
        raw, forward, execute = self._raw, GPUModelRunner._model_forward, \
            GPUModelRunner.execute_model
        self._saved = {"_model_forward": forward, "execute_model": execute}

        def timed_forward(runner, *args, **kwargs):
            rows = kwargs.get("input_ids")
            if rows is None:
                rows = kwargs.get("inputs_embeds")
            start = end = None
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = forward(runner, *args, **kwargs)
            host = (time.perf_counter() - t0) * 1e3
            if cuda:
                end.record()
            raw.append([-1 if rows is None else int(rows.shape[0]), host, start, end, 0.0])
            return out

        def timed_execute(runner, *args, **kwargs):
            before = len(raw)
            t0 = time.perf_counter()
            out = execute(runner, *args, **kwargs)
            if len(raw) > before:  # the step ran a forward: charge the step's host time to it
                raw[-1][4] = (time.perf_counter() - t0) * 1e3
            return out

        GPUModelRunner._model_forward = timed_forward
        GPUModelRunner.execute_model = timed_execute
        return self

    def __exit__(self, *exc) -> None:
        import torch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        for name, fn in self._saved.items():
            setattr(GPUModelRunner, name, fn)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.records = [ForwardRecord(n, host, host if start is None else start.elapsed_time(end),
                                      step)
                        for n, host, start, end, step in self._raw]


def summarize(records: list[ForwardRecord], min_tokens: int = 0,
              max_tokens: int | None = None) -> dict:
    """Mean host / device / step-host ms of the forwards with ``min_tokens`` to ``max_tokens``
    rows (``count`` 0 when none)."""
    sel = [r for r in records
           if r.tokens >= min_tokens and (max_tokens is None or r.tokens <= max_tokens)]
    if not sel:
        return {"count": 0}
    return {"count": len(sel),
            "tokens_mean": statistics.fmean(r.tokens for r in sel),
            "host_ms": statistics.fmean(r.host_ms for r in sel),
            "device_ms": statistics.fmean(r.device_ms for r in sel),
            "step_host_ms": statistics.fmean(r.step_host_ms for r in sel)}
