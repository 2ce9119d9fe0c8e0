"""vLLM 0.24 on CUDA: each projection's expert LoRA beside its base MoE GEMM, inside CUDA graphs.

In a decode step (a CUDA graph) an MoE layer's base GEMMs stream the experts' weights for tens of
microseconds each, while loraplex's LoRA ops of the same projection take ~10-20 µs, mostly fixed
latency; one after the other they add up. While a graph is captured, ``install`` makes each
projection's LoRA a branch on a second stream beside its base GEMM, joined before its result is
needed (rows token-major, ``[M*K, ...]``, as vLLM's LoRA hooks receive them)::

    main  [w13 GEMM] ...... join: y13 += d13 - activation h - fork - [w2 GEMM] .. join: y2 += d2
    aux   fork - d13 = (x A13^T) B13^T ----'                    '- d2 = w (h A2^T) B2^T --'

The main stream trades the four LoRA ops of a layer for two adds (``d13 [M*K, N]``,
``d2 [M*K, H]``, zeroed on the aux stream). Outside capture (prefill steps, bound by the host)
vLLM's sequential order stays: the extra launches and stream switches would cost host time.

Hooks (the call order both classes share): ``apply`` of vLLM's ``TritonExperts`` (bf16/fp16
experts) and ``UnfusedOAITritonExperts`` (MXFP4 experts under loraplex) forks the gate_up LoRA;
their ``activation`` forks the down LoRA on its output; the patched ``apply_w13_lora`` /
``apply_w2_lora`` of ``kernels.vllm_cuda`` join (``join_gate_up`` / ``join_down``); ``apply``
joins whatever is left before it returns, so a capture never ends with the aux stream forked.
Taken only for unquantised activations, loraplex's ops applying to the layer, and vLLM's own
dual-stream option off. Switch: ``LORAPLEX_MOE_LORA_OVERLAP=1`` (off by default).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

SWITCH_ENV = "LORAPLEX_MOE_LORA_OVERLAP"
_originals: dict[tuple[type, str], Callable | None] = {}  # the class's own attribute
_aux: dict[int, torch.cuda.Stream] = {}  # device index -> the aux stream


def enabled() -> bool:
    """True when the switch is set to a true value (``1``, ``true``, ``on``, ``yes``)."""
    return os.environ.get(SWITCH_ENV, "0").strip().lower() in {"1", "true", "on", "yes"}


class Branches:
    """One layer call's forked LoRA branches (kept on the LoRA context during ``apply``).

    Invariant: every event recorded on the aux stream is waited by the main stream before
    ``apply`` returns (``join_rest``)."""

    __slots__ = ("main", "aux", "topk_weights", "step", "d13", "ev13", "d2", "ev2")

    def __init__(self, main: torch.cuda.Stream, aux: torch.cuda.Stream,
                 topk_weights: torch.Tensor) -> None:
        self.main, self.aux, self.topk_weights = main, aux, topk_weights
        self.step = self.d13 = self.ev13 = self.d2 = self.ev2 = None

    def _fork(self, width: int, like: torch.Tensor, rows: int) -> torch.Tensor:
        """A delta buffer ``[rows, width]`` allocated on the main stream (it frees it after the
        join), zeroed on the aux stream after everything the main stream queued so far."""
        delta = torch.empty(rows, width, dtype=like.dtype, device=like.device)
        start = torch.cuda.Event()
        start.record(self.main)
        self.aux.wait_event(start)
        with torch.cuda.stream(self.aux):
            delta.zero_()
        return delta

    def _done(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.aux)
        return ev

    def fork_gate_up(self, gate_up: Callable, width: int, x: torch.Tensor, rows: int) -> None:
        """``gate_up(d13)`` (loraplex's gate_up LoRA into ``d13``, returning the step or a skip
        marker) on the aux stream."""
        self.d13 = self._fork(width, x, rows)
        with torch.cuda.stream(self.aux):
            self.step = gate_up(self.d13)
        self.ev13 = self._done()

    def fork_down(self, h: torch.Tensor, width: int) -> None:
        """The down LoRA of ``h [M*K, I]`` (the activation's output) into ``d2`` on the aux
        stream, after the gate_up branch's step."""
        self.d2 = self._fork(width, h, h.shape[0])
        with torch.cuda.stream(self.aux):
            self.step.down(self.d2, h, self.topk_weights)
        self.ev2 = self._done()

    def join_rest(self) -> None:
        for ev in (self.ev13, self.ev2):
            if ev is not None:
                self.main.wait_event(ev)
        self.ev13 = self.ev2 = None


def _aux_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _aux.get(index)
    if stream is None:
        stream = _aux[index] = torch.cuda.Stream(device=index)
    return stream


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _arg(args: tuple, kwargs: dict, name: str, position: int):
    return kwargs[name] if name in kwargs else args[position]


def _wrap_apply(original: Callable, plan: Callable) -> Callable:
    def apply(self, *args, **kwargs):
        ctx = getattr(self, "_lora_context", None)
        if ctx is None or not _capturing():
            return original(self, *args, **kwargs)
        x = _arg(args, kwargs, "hidden_states", 1)
        topk_weights = _arg(args, kwargs, "topk_weights", 4)
        topk_ids = _arg(args, kwargs, "topk_ids", 5)
        expert_map = _arg(args, kwargs, "expert_map", 8)
        gate_up = plan(self, ctx, x, topk_ids, expert_map)
        if gate_up is None:
            return original(self, *args, **kwargs)
        br = Branches(torch.cuda.current_stream(), _aux_stream(x.device), topk_weights)
        width = sum(b.shape[2] for b in ctx.w13_lora_b_stacked)
        br.fork_gate_up(gate_up, width, x, topk_ids.numel())
        ctx._loraplex_branches = br
        try:
            return original(self, *args, **kwargs)
        finally:
            ctx._loraplex_branches = None
            br.join_rest()
    return apply


def _wrap_activation(original: Callable, skip_marker: object) -> Callable:
    def activation(self, act, output, input, *args, **kwargs):
        original(self, act, output, input, *args, **kwargs)
        ctx = getattr(self, "_lora_context", None)
        br = getattr(ctx, "_loraplex_branches", None) if ctx is not None else None
        if br is not None and br.step is not skip_marker and br.ev2 is None:
            br.fork_down(output, ctx.w2_lora_b_stacked[0].shape[2])
    return activation


def join_gate_up(ctx, y2d: torch.Tensor):
    """In ``apply_w13_lora`` during a forked call: the main stream waits for the gate_up branch
    and adds its delta into ``y2d [M*K, N]``; returns the branch's step (or skip marker).
    ``None`` when the call was not forked."""
    br = getattr(ctx, "_loraplex_branches", None)
    if br is None or br.ev13 is None:
        return None
    br.main.wait_event(br.ev13)
    br.ev13 = None
    y2d.add_(br.d13)
    return br.step


def join_down(ctx, y2d: torch.Tensor) -> bool:
    """In ``apply_w2_lora`` during a forked call: the main stream waits for the down branch
    and adds its delta into ``y2d [M*K, H]``; False when no down branch was forked."""
    br = getattr(ctx, "_loraplex_branches", None)
    if br is None or br.ev2 is None:
        return False
    br.main.wait_event(br.ev2)
    br.ev2 = None
    y2d.add_(br.d2)
    return True


def install(classes: tuple[type, ...], plan: Callable, skip_marker: object) -> None:
    """Wraps ``apply`` and ``activation`` of ``classes`` (idempotent). ``plan(experts, ctx, x,
    topk_ids, expert_map)`` returns ``gate_up(d13)`` for a layer call loraplex's ops apply to
    (None: sequential)."""
    for cls in classes:
        for name, wrap in (("apply", lambda f: _wrap_apply(f, plan)),
                           ("activation", lambda f: _wrap_activation(f, skip_marker))):
            if (cls, name) not in _originals:
                _originals[(cls, name)] = cls.__dict__.get(name)  # None: inherited
                setattr(cls, name, wrap(getattr(cls, name)))


def uninstall() -> None:
    for (cls, name), own in _originals.items():
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)
    _originals.clear()
