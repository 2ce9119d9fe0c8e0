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
    """One layer call's forked LoRA branches (kept on the LoRA context during ``apply``):
    ``pending`` maps ``"gate_up"`` / ``"down"`` to (delta buffer, aux event) until joined.

    Invariant: every event recorded on the aux stream is waited by the main stream before
    ``apply`` returns (``join_rest``)."""

    __slots__ = ("main", "aux", "topk_weights", "step", "pending", "down_forked")

    def __init__(self, main: torch.cuda.Stream, aux: torch.cuda.Stream,
                 topk_weights: torch.Tensor) -> None:
        self.main, self.aux, self.topk_weights = main, aux, topk_weights
        self.step = None
        self.pending: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.down_forked = False

    def _fork(self, name: str, rows: int, width: int, like: torch.Tensor,
              run: Callable[[torch.Tensor], object]) -> object:
        """``run(delta)`` on the aux stream after everything the main stream queued so far,
        ``delta [rows, width]`` allocated on the main stream (which frees it after the join)
        and zeroed on the aux stream; returns what ``run`` returns."""
        delta = torch.empty(rows, width, dtype=like.dtype, device=like.device)
        start, done = torch.cuda.Event(), torch.cuda.Event()
        start.record(self.main)
        self.aux.wait_event(start)
        with torch.cuda.stream(self.aux):
            delta.zero_()
            out = run(delta)
        done.record(self.aux)
        self.pending[name] = (delta, done)
        return out

    def fork_gate_up(self, gate_up: Callable, width: int, x: torch.Tensor, rows: int) -> None:
        """``gate_up(d13)`` (loraplex's gate_up LoRA into ``d13 [rows, width]``, returning the
        step or a skip marker) on the aux stream."""
        self.step = self._fork("gate_up", rows, width, x, gate_up)

    def fork_down(self, h: torch.Tensor, width: int) -> None:
        """The down LoRA of ``h [M*K, I]`` (the activation's output) into ``d2 [M*K, width]``
        on the aux stream, after the gate_up branch (same stream)."""
        self.down_forked = True
        self._fork("down", h.shape[0], width, h,
                   lambda d2: self.step.down(d2, h, self.topk_weights))

    def join(self, name: str, y2d: torch.Tensor) -> bool:
        """The main stream waits for branch ``name`` and adds its delta into ``y2d``; False
        when that branch is not pending."""
        entry = self.pending.pop(name, None)
        if entry is None:
            return False
        self.main.wait_event(entry[1])
        y2d.add_(entry[0])
        return True

    def join_rest(self) -> None:
        for _, done in self.pending.values():
            self.main.wait_event(done)
        self.pending.clear()


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
        if br is not None and br.step is not skip_marker and not br.down_forked:
            br.fork_down(output, ctx.w2_lora_b_stacked[0].shape[2])
    return activation


def join_gate_up(ctx, y2d: torch.Tensor):
    """In ``apply_w13_lora`` during a forked call: the main stream waits for the gate_up branch
    and adds its delta into ``y2d [M*K, N]``; returns the branch's step (or skip marker).
    ``None`` when the call was not forked."""
    br = getattr(ctx, "_loraplex_branches", None)
    return br.step if br is not None and br.join("gate_up", y2d) else None


def join_down(ctx, y2d: torch.Tensor) -> bool:
    """In ``apply_w2_lora`` during a forked call: the main stream waits for the down branch
    and adds its delta into ``y2d [M*K, H]``; False when no down branch was forked."""
    br = getattr(ctx, "_loraplex_branches", None)
    return br is not None and br.join("down", y2d)


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
