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

    def _key(self, args: tuple, options: tuple) -> tuple:
        key = list(options)
        for a, const, no_spec in zip(args, self.constexpr, self.no_spec):
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif const or isinstance(a, bool) or a is None:
                key.append(a)
            elif isinstance(a, int):
                key.append(_INT32[0] <= a <= _INT32[1] if no_spec else a)
            elif isinstance(a, float):
                key.append("f")
            else:
                key.append(a)
        return tuple(key)

    def __call__(self, grid: tuple, *leading, num_warps: int, num_stages: int | None = None,
                 launch_pdl: bool = False, **named) -> None:
        args = leading + tuple(named[n] for n in self.names[len(leading):])
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if launch_pdl:
            options["launch_pdl"] = True
        if self.interpreted:
            self.fn[grid](*args, **options)
            return
        key = self._key(args, (num_warps, num_stages, launch_pdl))
        kernel = self.variants.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **options)
            if kernel is not None:
                self.variants[key] = kernel
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, torch.cuda.current_stream().cuda_stream, kernel.function,
                   kernel.packed_metadata, None, None, None, *args)
