"""Kept launches of triton_kernels' ``matmul_ogs`` (vLLM 0.24's bundled copy, v3.5 API) for the
MXFP4 experts' sorted-row path.

Why: ``matmul_ogs`` prepares every call in Python — optimisation flags, tensor wrappers,
storage views, then Triton's generic launch of a kernel with ~90 arguments. A prefill step runs
outside CUDA graphs and is host-bound on MXFP4 (its expert GEMMs are short), so the two calls
per MoE layer sit on the step's critical path.

How: the first call for a key runs ``matmul_ogs`` itself, with its kernel lookup
(``get_kernels``) answered by a recorder: the one matmul launch goes through
``CachedLauncher.prepare`` (the compiled variant kept) and every tensor among its arguments is
traced to one of the call's inputs — the input whose bytes hold its first address, and the byte
offset into it. A later call with the same key launches that variant with the same arguments,
each pointer read from the new inputs at the traced path and offset. A call whose launch cannot
be traced — a second kernel (a grouped reduction), a pointer into a buffer allocated inside (a
scratchpad), a descriptor object, an address two inputs could hold — marks its key not
keepable: such calls always run ``matmul_ogs``.

The key holds what the launch's other arguments derive from: shapes, strides and dtypes of the
activations, output and index tensors, which optional inputs are given, the routing's expert
counts, a signature of the weights and of the precision config (computed once per object), and
the optimisation-flag constraints in force. Triton also specialises on each pointer's 16-byte
alignment: checked per call (a call that differs runs ``matmul_ogs``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import torch

from kernels.launch.arguments import (
    SCALARS,
    resolve,
    signature,
    tensor_paths,
    trace,
    unwrap_pointer,
)
from kernels.launch.cached import CachedLauncher, PlanTable, raw_stream

_MATMUL_KERNELS = ("_matmul_ogs", "_p_matmul_ogs")
_OPTIONS = ("num_warps", "num_stages")
_UNKEPT = "not keepable"


@dataclasses.dataclass
class KeptCall:
    """One traced launch: ``template`` holds its arguments with None where a pointer goes;
    ``traced`` says, per input path the pointers come from, ``(path, ((position, offset,
    16-byte aligned when recorded), ...))`` — each input is looked up once per call."""

    plan: object
    template: list
    traced: tuple

    def arguments(self, roots: tuple) -> list | None:
        """The launch's arguments for ``roots`` (None when a pointer's alignment differs)."""
        args = self.template.copy()
        for path, uses in self.traced:
            base = resolve(roots, path).data_ptr()
            for pos, off, was in uses:
                ptr = base + off
                if (ptr & 15 == 0) is not was:
                    return None
                args[pos] = ptr
        return args


def _hashable(values: list) -> bool:
    """Whether the non-tensor values can key a launch variant (``CachedLauncher``)."""
    try:
        hash(tuple(v for v in values if not isinstance(v, torch.Tensor)))
    except TypeError:
        return False
    return True


class _Recorder:
    """``get_kernels`` during one ``matmul_ogs`` call: the real kernels, with the matmul
    kernel's launch made through a ``CachedLauncher`` and noted; any other kernel noted too."""

    def __init__(self, get_kernels, launchers: dict, launcher_factory) -> None:
        self.real = get_kernels
        self.launchers, self.factory = launchers, launcher_factory
        self.launches: list[tuple] = []
        self.why: str | None = None  # the first reason the call cannot be kept

    def get_kernels(self, *args, **kwargs):
        return _KernelsView(self.real(*args, **kwargs), self)

    def refuse(self, why: str) -> None:
        self.why = self.why or why

    def launch(self, fn, grid: tuple, args: tuple, kwargs: dict):
        names = list(fn.arg_names)
        # a launch option given as None is as if not given (Triton drops it: ``arch=None``)
        options = {k: v for k, v in kwargs.items() if k not in names and v is not None}
        full = list(args)
        for i, name in enumerate(names[len(args):], start=len(args)):
            default = fn.params[i].default if hasattr(fn, "params") else inspect.Parameter.empty
            full.append(kwargs.get(name, default))
        full = [unwrap_pointer(v) for v in full]  # as Triton launches them
        why = self._unkeepable(options, full)
        if why:
            self.refuse(why)
            return fn[grid](*args, **kwargs)
        launcher = self.launchers.get(fn)
        if launcher is None:
            launcher = self.launchers[fn] = self.factory(fn)
        plan = launcher.prepare(grid, *full, lead=len(full),
                                num_warps=options.get("num_warps", 4),
                                num_stages=options.get("num_stages"))
        self.launches.append((plan, full))

    def _unkeepable(self, options: dict, full: list) -> str | None:
        """Why this launch cannot be kept as one variant, or None."""
        if self.launches:
            return "a second launch"
        if set(options) - set(_OPTIONS):
            return f"launch options {sorted(set(options) - set(_OPTIONS))}"
        if any(v is inspect.Parameter.empty for v in full):
            return "an argument without a value"
        if not _hashable(full):
            return "an unhashable argument"
        return None

    def kept_call(self, roots: tuple) -> KeptCall | None:
        """The noted launch as a ``KeptCall`` for ``roots``' inputs, or None if untraceable
        (``why`` says what stopped it)."""
        if len(self.launches) != 1:
            self.refuse("no launch of a matmul kernel")
        if self.why:
            return None
        plan, full = self.launches[0]
        if not getattr(plan, "compiled", False):
            self.refuse("the launch was not compiled through the kept launcher")
            return None
        sources = tensor_paths(roots)
        template, traced = [], {}
        for pos, value in enumerate(full):
            if isinstance(value, torch.Tensor):
                hit = trace(value, sources)
                if hit is None:
                    self.refuse(f"argument {pos}: an address no input holds (or two do)")
                    return None
                template.append(None)
                path, off = hit
                traced.setdefault(path, []).append((pos, off, value.data_ptr() & 15 == 0))
            elif isinstance(value, SCALARS):
                template.append(value)
            else:  # a descriptor or other object made per call
                self.refuse(f"argument {pos}: a {type(value).__name__}")
                return None
        return KeptCall(plan, template, tuple((p, tuple(u)) for p, u in traced.items()))


class _KernelsView:
    def __init__(self, kernels, recorder: _Recorder) -> None:
        self._kernels, self._recorder = kernels, recorder

    def __getattr__(self, name: str):
        fn = getattr(self._kernels, name)
        if name in _MATMUL_KERNELS:
            return _NotedKernel(fn, self._recorder)
        self._recorder.refuse(f"a second kernel ({name})")
        return fn


class _NotedKernel:
    def __init__(self, fn, recorder: _Recorder) -> None:
        self.fn, self.recorder = fn, recorder

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.recorder.launch(self.fn, grid, args, kwargs)


class KeptMatmulOgs:
    """``matmul_ogs(x, w, bias, routing, gather_indx=, scatter_indx=, precision_config=,
    gammas=, y=)`` with kept launches (module docstring). ``y`` is required and written; the
    return value is None. ``module``: the module ``matmul_ogs`` looks ``get_kernels`` up in;
    ``opt_flags``: the module holding the optimisation-flag constraints."""

    def __init__(self, module, opt_flags=None, launcher_factory=CachedLauncher,
                 max_entries: int = 2048) -> None:
        self.module, self.opt_flags = module, opt_flags
        self.factory = launcher_factory
        self.calls = PlanTable(max_entries)
        self.launchers: dict = {}
        self._static: dict[int, tuple] = {}
        self.counts = {"kept": 0, "recorded": 0, "matmul_ogs": 0}
        self.refusals: dict[str, int] = {}  # why recorded calls were not kept -> how many

    def __call__(self, x, w, bias, routing, gather_indx=None, scatter_indx=None,
                 precision_config=None, gammas=None, y=None) -> None:
        roots = (x, w, bias, routing, gather_indx, scatter_indx, precision_config, gammas, y)
        key = self.key(roots)
        entry = self.calls.get(key)
        if entry is not None and entry is not _UNKEPT:
            args = entry.arguments(roots)
            if args is not None:
                self.counts["kept"] += 1
                entry.plan.launch(raw_stream(x.device), *args)
                return
        if entry is None and y is not None:
            self._record(key, roots)
            return
        self.counts["matmul_ogs"] += 1
        self._matmul_ogs(roots)

    def _matmul_ogs(self, roots: tuple):
        x, w, bias, routing, gather, scatter, precision, gammas, y = roots
        return self.module.matmul_ogs(x, w, bias, routing, gather_indx=gather,
                                      scatter_indx=scatter, precision_config=precision,
                                      gammas=gammas, y=y)

    def _record(self, key: tuple, roots: tuple) -> None:
        recorder = _Recorder(self.module.get_kernels, self.launchers, self.factory)
        self.module.get_kernels = recorder.get_kernels
        try:
            self._matmul_ogs(roots)
        finally:
            self.module.get_kernels = recorder.real
        self.counts["recorded"] += 1
        entry = recorder.kept_call(roots)
        if entry is None:
            self.refusals[recorder.why] = self.refusals.get(recorder.why, 0) + 1
        self.calls.put(key, entry or _UNKEPT)

    def _static_signature(self, obj):
        """``signature(obj)`` for the weights and precision configs (the same objects every
        step: computed once per object, which is kept alive so its id stays its own)."""
        hit = self._static.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        if len(self._static) >= 4096:
            self._static.clear()
        sig = signature(obj)
        self._static[id(obj)] = (obj, sig)
        return sig

    def key(self, roots: tuple) -> tuple:
        """What the launch's arguments other than pointers derive from (module docstring)."""
        x, w, bias, routing, gather, scatter, precision, gammas, y = roots
        flags = self.opt_flags
        return (
            tuple(x.shape), x.stride(), x.dtype,
            self._static_signature(w), self._static_signature(precision),
            None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype),
            None if gammas is None else (tuple(gammas.shape), gammas.stride(), gammas.dtype),
            None if y is None else (tuple(y.shape), y.stride(), y.dtype),
            None if gather is None else (tuple(gather.src_indx.shape), gather.src_indx.dtype),
            None if scatter is None else (tuple(scatter.src_indx.shape),
                                          scatter.src_indx.dtype),
            None if routing is None else (routing.n_expts_tot, routing.n_expts_act,
                                          routing.expected_tokens_per_expt,
                                          routing.expt_data is None),
            None if flags is None else (tuple(flags._opt_flags_constraints.items()),
                                        id(flags._opt_flags)),
        )


_KEPT: dict = {}  # matmul_ogs function -> its KeptMatmulOgs, or the function itself


def kept_matmul_ogs(matmul_ogs):
    """A ``KeptMatmulOgs`` for vLLM 0.24's ``matmul_ogs`` (one per function), or the function
    itself when keeping does not apply: ``LORAPLEX_KEPT_MATMUL=0``, the Triton interpreter, or
    a ``matmul_ogs`` whose module or signature is not the one this was written against."""
    hit = _KEPT.get(matmul_ogs)
    if hit is None:
        hit = _KEPT[matmul_ogs] = _make(matmul_ogs)
    return hit


_SIGNATURE = ("x", "w", "bias", "routing_data", "gather_indx", "scatter_indx",
              "precision_config", "betas", "gammas", "out_alpha", "y", "fused_activation",
              "epilogue")


def _make(matmul_ogs):
    if (os.environ.get("LORAPLEX_KEPT_MATMUL", "1") == "0"
            or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return matmul_ogs
    module = sys.modules.get(getattr(matmul_ogs, "__module__", ""))
    try:
        params = tuple(inspect.signature(matmul_ogs).parameters)
    except (TypeError, ValueError):
        return matmul_ogs
    if (module is None or getattr(module, "matmul_ogs", None) is not matmul_ogs
            or not callable(getattr(module, "get_kernels", None)) or params != _SIGNATURE):
        return matmul_ogs
    flags = sys.modules.get(module.__name__.rsplit(".", 1)[0] + ".matmul_ogs_details.opt_flags")
    if flags is not None and not hasattr(flags, "_opt_flags_constraints"):
        flags = None
    return KeptMatmulOgs(module, flags)
