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
        args = leading + tuple(named[n] for n in self.names[len(leading):])
        kernel = None if self.interpreted else self.variants.get(
            key := self._key(args, (num_warps, num_stages, launch_pdl)))
        if kernel is None:
            options = {"num_warps": num_warps}
            if num_stages is not None:
                options["num_stages"] = num_stages
            if launch_pdl:
                options["launch_pdl"] = True
            kernel = self.fn[grid](*args, **options)
            if kernel is not None and not self.interpreted:
                self.variants[key] = kernel
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, _current_stream(), kernel.function, kernel.packed_metadata,
                   None, None, None, *args)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver uses


def _current_stream() -> int:
    if _raw_stream is not None:
        return _raw_stream(torch.cuda.current_device())
    return torch.cuda.current_stream().cuda_stream
