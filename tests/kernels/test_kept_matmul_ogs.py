"""``kernels.launch.kept_matmul_ogs``: a kept launch passes the kernel exactly the arguments
``matmul_ogs`` itself would pass for the new inputs (pointers as addresses), and calls it cannot
trace always run ``matmul_ogs``.

Anywhere: with a stand-in ``matmul_ogs`` module shaped like triton_kernels' (dataclass inputs,
views at offsets, a kernel found through ``get_kernels``, shape-derived integers and
constexprs) and a stand-in launcher. On a GPU with vLLM 0.24: the real ``matmul_ogs`` on MXFP4
experts, kept launches against its own output.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import pytest
import torch

from kernels.launch import arguments as launch_arguments
from kernels.launch import kept_matmul_ogs as kmo
from tests.helpers.vllm_gpu import needs_vllm024_gpu


@dataclass
class Storage:
    data: torch.Tensor
    layout: object = None


@dataclass
class Weights:
    storage: Storage
    shape: list


@dataclass
class ExptData:
    hist: torch.Tensor
    token_offs_raw: torch.Tensor
    token_offs_pad: dict
    block_pid_map: dict


@dataclass
class Routing:
    gate_scal: torch.Tensor
    expt_hist: torch.Tensor
    n_expts_tot: int
    n_expts_act: int
    expt_data: ExptData = None
    expected_tokens_per_expt: int = field(default=None)


@dataclass
class Indx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass
class Wrapped:
    """triton_kernels' ``Tensor``: an unhashable dataclass Triton launches as a pointer of its
    ``dtype`` through ``data_ptr()``."""

    storage: Storage
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.storage.data.data_ptr()

    @property
    def data(self) -> torch.Tensor:
        return self.storage.data


@dataclass
class Precision:
    weight_scale: Wrapped
    allow_tf32: bool = True


class Param:
    def __init__(self, default=inspect.Parameter.empty):
        self.default = default


class Kernel:
    """A kernel's face: ``arg_names``, ``params`` and ``[grid](...)``, which notes the
    arguments (tensors as addresses) in ``module.launched``."""

    arg_names = ["y", "y_stride", "x", "x_stride", "w", "scale", "bias", "gammas", "src", "sum",
                 "pid_map", "M", "N", "BLOCK_M", "SWIZZLE", "EVEN_K"]

    def __init__(self, module):
        self.module = module
        self.params = [Param() for _ in self.arg_names[:-1]] + [Param(True)]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.module.launched.append((grid, addresses(full_arguments(self, args, kwargs))))
        return launch


def full_arguments(fn, args, kwargs):
    full = list(args)
    for i, name in enumerate(fn.arg_names[len(args):], start=len(args)):
        full.append(kwargs[name] if name in kwargs else fn.params[i].default)
    return full


def addresses(values):
    return [v.data_ptr() if callable(getattr(v, "data_ptr", None)) else v for v in values]


def stand_in_module():
    """A module with ``get_kernels`` and a ``matmul_ogs`` that prepares views at offsets and
    shape-derived values and the weight scale as a pointer wrapper, then launches
    ``get_kernels()._matmul_ogs``. ``mode``: "scratch" (output through a buffer allocated
    inside), "reduce" (a second kernel looked up), "object" (a descriptor object among the
    arguments), "unhashable" (an argument no variant key can hold), "wrapped_dtype" (a wrapper
    whose dtype is not its data's), "arch" (a launch option other than warps and stages; given
    as None otherwise, as matmul_ogs does)."""
    mod = types.ModuleType("stand_in_matmul_ogs")
    mod.launched, mod.mode, mod.kernel = [], None, None
    mod.kernel = Kernel(mod)
    mod.get_kernels = lambda *a: types.SimpleNamespace(_matmul_ogs=mod.kernel,
                                                       _reduce_grouped=mod.kernel)

    def matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None,
                   precision_config=None, betas=None, gammas=None, out_alpha=None, y=None,
                   fused_activation=None, epilogue=None):
        kernels = mod.get_kernels(None, None)
        m, n = x.shape[0], w.shape[-1]
        block_m = 16 if m < 64 else 64
        out = torch.empty_like(y) if mod.mode == "scratch" else y
        if mod.mode == "reduce":
            kernels._reduce_grouped
        x3 = x.as_strided((1, *x.shape), (0, *x.stride()))
        hist_sum = routing_data.expt_data.token_offs_pad[block_m][-1]
        w_scale = precision_config.weight_scale  # re-viewed per call, as triton_kernels does
        w_scale.storage.data = w_scale.data.view(torch.uint8)
        w_scale.dtype = torch.uint8 if mod.mode != "wrapped_dtype" else torch.int8
        kernels._matmul_ogs[(-(-m // block_m) * 3,)](
            out.view(-1, out.shape[-1]), out.stride(-2), x3, x.stride(0),
            w.storage.data.view(torch.uint8), w_scale, bias, gammas,
            None if gather_indx is None else gather_indx.src_indx, hist_sum,
            {"unhashable": 1} if mod.mode == "unhashable" else
            object() if mod.mode == "object" else routing_data.expt_data.block_pid_map[block_m],
            m, n, num_warps=4, num_stages=2, BLOCK_M=block_m, SWIZZLE="hopper",
            arch="sm90" if mod.mode == "arch" else None)

    mod.matmul_ogs = matmul_ogs
    return mod


class Plan:
    compiled = True

    def __init__(self, module, grid):
        self.module, self.grid = module, grid

    def launch(self, stream, *args):
        self.module.launched.append((self.grid, list(args)))


def launcher_factory(module):
    def factory(fn):
        def prepare(grid, *args, lead, num_warps, num_stages):
            assert lead == len(args) == len(fn.arg_names) and (num_warps, num_stages) == (4, 2)
            hash(tuple(a for a in args if not isinstance(a, torch.Tensor)))  # as variants key
            fn[grid](*args)  # the one launch of the recorded call
            return Plan(module, grid)
        return types.SimpleNamespace(prepare=prepare)
    return factory


def inputs(m: int, seed: int, experts: int = 5, hidden: int = 24, n: int = 40, offset: int = 0):
    """Fresh inputs of one call (a new layer's weights each seed): ``offset`` elements into its
    buffers, so addresses and alignment move."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m + offset, hidden, generator=g)[offset:]
    w = Weights(Storage(torch.randint(0, 255, (experts, hidden, n // 2), dtype=torch.uint8,
                                      generator=g)), [experts, hidden, n])
    pad = {bm: torch.arange(experts + 1, dtype=torch.int32) * bm for bm in (16, 32, 64)}
    pid = {bm: torch.zeros(m + experts, dtype=torch.int32) for bm in (16, 32, 64)}
    hist = torch.randint(0, m, (experts,), dtype=torch.int32, generator=g)
    routing = Routing(torch.rand(m * 2, generator=g), hist, experts, 2,
                      ExptData(hist, torch.zeros(experts + 1, dtype=torch.int32), pad, pid))
    gather = Indx(torch.randperm(m * 2, generator=g).int(), torch.randperm(m * 2).int())
    precision = Precision(Wrapped(Storage(torch.ones(experts, n, dtype=torch.uint8)),
                                  torch.uint8))
    y = torch.empty(1, m * 2, n)
    return (x, w, torch.randn(experts, n, generator=g), routing, gather, None, precision,
            routing.gate_scal, y)


def call(kept, roots):
    x, w, bias, routing, gather, scatter, precision, gammas, y = roots
    kept(x, w, bias, routing, gather_indx=gather, scatter_indx=scatter,
         precision_config=precision, gammas=gammas, y=y)


def own_launch(mod, roots):
    """What ``matmul_ogs`` itself passes its kernel for ``roots``."""
    mod.launched.clear()
    kmo.KeptMatmulOgs(mod)._matmul_ogs(roots)
    (launch,) = mod.launched
    return launch


@pytest.mark.parametrize("m", [1, 7, 63, 200])
def test_kept_launches_pass_what_matmul_ogs_would(m):
    mod = stand_in_module()
    kept = kmo.KeptMatmulOgs(mod, launcher_factory=launcher_factory(mod))
    for seed in range(4):  # a new layer and new activations each call, the same shapes
        roots = inputs(m, seed)
        want = own_launch(mod, roots)
        mod.launched.clear()
        call(kept, roots)
        assert mod.launched == [want]
        assert mod.get_kernels is not None and not hasattr(mod.get_kernels, "__self__")
    assert kept.counts == {"kept": 3, "recorded": 1, "matmul_ogs": 0}
    # another token count: recorded again, then kept
    for seed in (7, 8):
        roots = inputs(m + 64, seed)
        want = own_launch(mod, roots)
        mod.launched.clear()
        call(kept, roots)
        assert mod.launched == [want]
    assert kept.counts == {"kept": 4, "recorded": 2, "matmul_ogs": 0}


@pytest.mark.parametrize("mode, why", [
    ("scratch", "argument 0: an address no input holds"),
    ("reduce", "a second kernel (_reduce_grouped)"),
    ("object", "argument 10: a object"),
    ("unhashable", "an unhashable argument"),
    ("wrapped_dtype", "an unhashable argument"),
    ("arch", "launch options ['arch']"),
])
def test_untraceable_calls_always_run_matmul_ogs(mode, why):
    mod = stand_in_module()
    mod.mode = mode
    kept = kmo.KeptMatmulOgs(mod, launcher_factory=launcher_factory(mod))
    for seed in range(3):
        roots = inputs(9, seed)
        mod.launched.clear()
        call(kept, roots)
        assert len(mod.launched) == 1  # matmul_ogs' own launch, once per call
    assert kept.counts == {"kept": 0, "recorded": 1, "matmul_ogs": 2}
    (reason,) = kept.refusals  # one recorded call, refused for what the mode put in
    assert reason.startswith(why), reason


def test_a_pointer_whose_alignment_differs_runs_matmul_ogs():
    mod = stand_in_module()
    kept = kmo.KeptMatmulOgs(mod, launcher_factory=launcher_factory(mod))
    call(kept, inputs(9, 0))
    roots = inputs(9, 1, offset=1)  # x one row (96 bytes) in: still aligned
    want = own_launch(mod, roots)
    mod.launched.clear()
    call(kept, roots)
    assert mod.launched == [want] and kept.counts["kept"] == 1
    x, *rest = inputs(9, 2)
    shifted = torch.randn(x.numel() + 1)[1:].view_as(x)  # 4 bytes in: not 16-byte aligned
    roots = (shifted, *rest)
    want = own_launch(mod, roots)
    mod.launched.clear()
    call(kept, roots)
    assert mod.launched == [want] and kept.counts == {"kept": 1, "recorded": 1, "matmul_ogs": 1}


def test_trace_refuses_addresses_two_inputs_hold():
    buf = torch.zeros(64)
    a, b = buf[:40], buf[8:]  # overlapping, different starts
    assert launch_arguments.trace(buf[10:], [((0,), a), ((1,), b)]) is None
    assert launch_arguments.trace(buf[10:], [((0,), a)]) == ((0,), 40)
    same = [((0,), buf), ((1, (False, "x")), buf)]  # one tensor reached twice
    assert launch_arguments.trace(buf[3:], same) == ((0,), 12)
    assert launch_arguments.trace(torch.zeros(3), same) is None


def test_keeping_applies_only_to_the_known_matmul_ogs(monkeypatch):
    mod = stand_in_module()
    assert kmo.kept_matmul_ogs(mod.matmul_ogs) is mod.matmul_ogs  # not a module of its own

    def matmul_ogs(x, w):  # another signature
        return x

    assert kmo.kept_matmul_ogs(matmul_ogs) is matmul_ogs


@needs_vllm024_gpu
@pytest.mark.parametrize("m", [1, 16, 300, 1615])
def test_kept_matmul_ogs_equals_matmul_ogs_on_mxfp4_experts(monkeypatch, m):
    """Both GEMMs of the sorted-row path (w13 with the token gather into sorted rows; w2 with
    the pair scatter and routing weights), two layers, fresh routing per call: the kept
    launches write exactly what ``matmul_ogs`` writes."""
    from vllm.utils.import_utils import import_triton_kernels

    import_triton_kernels()
    from triton_kernels.matmul_ogs import matmul_ogs

    from benchmarks.kernels.mxfp4_experts import (
        HIDDEN,
        INTER,
        TOP_K,
        expert_layers,
        sorted_row_inputs,
    )

    monkeypatch.delenv("LORAPLEX_KEPT_MATMUL", raising=False)
    kmo._KEPT.pop(matmul_ogs, None)
    kept = kmo.kept_matmul_ogs(matmul_ogs)
    assert isinstance(kept, kmo.KeptMatmulOgs)
    layers = expert_layers(2)
    for step in range(3):
        x, routing, gather, scatter, route_1 = sorted_row_inputs(m, seed=step)
        for w1, p1, b1, w2, p2, b2 in layers:
            outs = []
            for fn in (matmul_ogs, kept):
                y13 = torch.full((1, m * TOP_K, 2 * INTER), float("nan"), device="cuda",
                                 dtype=torch.bfloat16)
                fn(x, w1, b1, routing, gather_indx=gather, precision_config=p1, y=y13)
                act = y13.view(m * TOP_K, 2 * INTER)[:, :INTER].contiguous()
                y2 = torch.full((1, m * TOP_K, HIDDEN), float("nan"), device="cuda",
                                dtype=torch.bfloat16)
                fn(act, w2, b2, route_1, scatter_indx=scatter, precision_config=p2,
                   gammas=route_1.gate_scal, y=y2)
                outs.append((y13, y2))
            for mine, theirs in zip(outs[1], outs[0]):  # unwritten rows would stay NaN in both
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    assert kept.counts["kept"] >= 2 * 2 * 3 - 2 and kept.counts["matmul_ogs"] == 0, \
        (kept.counts, kept.refusals)
