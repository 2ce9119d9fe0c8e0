"""Cheap repeat launches of Triton kernels: Triton's specialisation work done once per variant.

``kernel[grid](...)`` binds every argument, computes its specialisation (dtype, 16-byte
alignment, integer value classes), builds a cache key string and looks the compiled variant up
on each call: tens of µs of CPU per launch. A prefill step runs outside CUDA graphs, so the CPU
issues every LoRA launch of every layer, and that cost adds up to milliseconds per step.

``CachedLauncher`` keys variants on the facts Triton specialises on — constexpr values, tensor
dtypes and 16-byte alignment, the values of specialised integers, the 32/64-bit class of
``do_not_specialize`` integers, launch options — and launches a known variant straight through
its compiled launcher (``CompiledKernel.run``, as Triton's own ``kernel[grid]`` runner does). A
new key goes through Triton's normal path (compiling if needed) and is remembered. Under the
Triton interpreter every call takes the normal path.
"""

from __future__ import annotations

import torch

_INT32 = (-(2**31), 2**31 - 1)
MAX_VARIANTS = 4096  # kept variants per launcher


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` costs microseconds per call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class CachedLauncher:
    """Launches ``fn`` (a ``@triton.jit`` function): ``launcher(grid, *leading_args,
    num_warps=, num_stages=, launch_pdl=, **the_remaining_parameters_by_name)``."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.names = list(fn.arg_names)
        self.variants: dict[tuple, object] = {}
        params = getattr(fn, "params", None)  # a JITFunction's; the interpreter's has none
        self.interpreted = params is None
        self.constexpr = [bool(p.is_constexpr) for p in params or ()]
        self.no_spec = [bool(getattr(p, "do_not_specialize", False)) for p in params or ()]
        self._tensors = self._widths = self._values = None

    def _layout(self, args: tuple) -> None:
        """Sorts the parameter positions by what Triton specialises on (fixed per call site):
        tensors (dtype, 16-byte alignment), ``do_not_specialize`` integers (32/64-bit class),
        floats (nothing), the rest (value: constexprs, specialised integers, flags)."""
        tensors, widths, values = [], [], []
        for i, (a, const, no_spec) in enumerate(zip(args, self.constexpr, self.no_spec)):
            if isinstance(a, torch.Tensor):
                tensors.append(i)
            elif const or isinstance(a, bool) or a is None:
                values.append(i)
            elif isinstance(a, float):
                continue
            elif isinstance(a, int) and no_spec:
                widths.append(i)
            else:
                values.append(i)
        self._tensors, self._widths, self._values = tuple(tensors), tuple(widths), tuple(values)

    def _key(self, args: tuple, options: tuple) -> tuple:
        if self._values is None:
            self._layout(args)
        try:
            return (options, tuple([args[i] for i in self._values]),
                    tuple([(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in self._tensors]),
                    tuple([_INT32[0] <= args[i] <= _INT32[1] for i in self._widths]))
        except (AttributeError, TypeError):  # a position changed kind: sort again
            self._layout(args)
            return self._key(args, options)

    def __call__(self, grid: tuple, *leading, num_warps: int, num_stages: int | None = None,
                 launch_pdl: bool = False, **named) -> None:
        self._launch(grid, leading, num_warps, num_stages, launch_pdl, named)

    def prepare(self, grid: tuple, *leading, lead: int | None = None, num_warps: int,
                num_stages: int | None = None, launch_pdl: bool = False,
                **named) -> "PreparedLaunch":
        """Launches like ``__call__`` and returns that launch, ready to repeat with its first
        ``lead`` arguments (default: all positional ones) given anew (``PreparedLaunch``)."""
        args, kernel, options = self._launch(grid, leading, num_warps, num_stages, launch_pdl,
                                             named)
        return PreparedLaunch(self.fn, grid, args, options, kernel,
                              len(leading) if lead is None else lead)

    def _launch(self, grid, leading, num_warps, num_stages, launch_pdl, named):
        args = leading + tuple(named[n] for n in self.names[len(leading):])
        options = (num_warps, num_stages, launch_pdl)
        kernel = None if self.interpreted else self.variants.get(key := self._key(args, options))
        if kernel is None:
            kw = {"num_warps": num_warps}
            if num_stages is not None:
                kw["num_stages"] = num_stages
            if launch_pdl:
                kw["launch_pdl"] = True
            kernel = self.fn[grid](*args, **kw)
            if kernel is not None and not self.interpreted:
                if len(self.variants) >= MAX_VARIANTS:  # integers a kernel specialises on
                    self.variants.clear()  # vary with the batch: the ones in use come back
                self.variants[key] = kernel
            return args, (None if self.interpreted else kernel), kw
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, raw_stream(_CURRENT_CUDA), kernel.function,
                   kernel.packed_metadata, None, None, None, *args)
        return args, kernel, None


class PreparedLaunch:
    """One kernel variant at one grid with the arguments after its first ``lead`` ones, for
    launching again with those given anew: ``launch(stream, *first_lead_arguments)``.

    What the launch costs the CPU is the argument list and the driver call: no specialisation,
    no key, no option handling. The caller guarantees that the new arguments stay within the
    variant's specialisation: tensors of the same dtype and 16-byte alignment, integers that are
    ``do_not_specialize`` and stay in the same 32/64-bit class (or keep their value). Nothing of
    a call is kept after it (the tensors, which may be large activations, belong to the caller),
    so the kept ``tail`` must hold no tensor that could be freed. ``stream``: the raw CUDA
    stream (``raw_stream``; ignored under the interpreter).
    """

    __slots__ = ("tail", "extra", "_grid", "_c_launch", "_head", "_run", "_fn", "_options")

    def __init__(self, fn, grid: tuple, args: tuple, options: dict | None, kernel,
                 lead: int) -> None:
        self.tail = tuple(args[lead:])
        self.extra = None  # what the call site keeps beside the launch (e.g. a buffer shape)
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._fn, self._options = fn, options
        self._c_launch = self._run = None
        if kernel is not None:
            run = kernel.run
            self._run = (kernel, run)
            c_launch = getattr(run, "launch", None)
            if (callable(c_launch) and getattr(run, "global_scratch_size", 1) == 0
                    and getattr(run, "profile_scratch_size", 1) == 0):
                # straight into the compiled launcher (what Triton's own launcher class calls)
                self._c_launch = c_launch
                self._head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None,
                              None, kernel.packed_metadata, None, None, None)

    @property
    def compiled(self) -> bool:
        """Whether a compiled variant is kept (False under the interpreter: every launch then
        takes Triton's normal path, which needs tensors where pointers go)."""
        return self._run is not None

    def launch(self, stream: int, *leading) -> None:
        g = self._grid
        if self._c_launch is not None:
            self._c_launch(g[0], g[1], g[2], stream, *self._head, *leading, *self.tail)
        elif self._run is not None:
            kernel, run = self._run
            run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None,
                None, *leading, *self.tail)
        else:  # interpreter (or a variant Triton did not hand back): the normal path
            self._fn[g](*leading, *self.tail, **(self._options or {}))


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver uses
_CURRENT_CUDA = torch.device("cuda")  # no index: the current device


def raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` (no index: the current device) as the driver
    handle Triton launches on (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    if _raw_stream is None:
        stream = (torch.cuda.current_stream() if device.index is None
                  else torch.cuda.current_stream(device.index))
        return stream.cuda_stream
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


class PlanTable:
    """Prepared launches by call key, for call sites that run the same shapes over and over
    (every layer of a step, every step of a batch size). The key must hold everything the
    launch's fixed arguments and grid derive from, and the specialisation facts of the
    arguments replaced per call (dtypes, 16-byte alignment). At most ``max_entries`` are kept
    (all are dropped when full: the batch sizes in use come back)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.plans: dict[tuple, object] = {}
        self.max_entries = max_entries

    def get(self, key: tuple):
        return self.plans.get(key)

    def put(self, key: tuple, plan) -> None:
        if len(self.plans) >= self.max_entries:
            self.plans.clear()
        self.plans[key] = plan


class LaunchPlans(PlanTable):
    """A ``PlanTable`` of one kernel's launches (``PreparedLaunch``)."""

    def __init__(self, launcher: CachedLauncher, max_entries: int = 1024) -> None:
        super().__init__(max_entries)
        self.launcher = launcher

    def launch_new(self, key: tuple, grid: tuple, args: tuple, kwargs: dict, lead: int,
                   extra=None) -> PreparedLaunch:
        """Launches ``args`` at ``grid`` (leading positional arguments of the kernel, then the
        launch options and the rest by name in ``kwargs``) and keeps it under ``key``, to be
        launched again with its first ``lead`` arguments given anew (every tensor among them),
        with ``extra`` in its ``extra`` slot; returns it."""
        plan = self.launcher.prepare(grid, *args, lead=lead, **kwargs)
        plan.extra = extra
        self.put(key, plan)
        return plan


def aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data starts on a 16-byte boundary (Triton specialises on it)."""
    ptr = 0
    for t in tensors:
        ptr |= t.data_ptr()
    return ptr & 15 == 0
