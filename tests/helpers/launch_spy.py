"""Which Triton kernel variants code launches through ``kernels.launch.cached`` (first launches
and kept ``PreparedLaunch``es alike), keyed by what Triton compiles a variant for: kernel, launch
options, constexpr values and tensor dtypes (the same under the interpreter, where nothing is
compiled)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch

from kernels.launch.cached import CachedLauncher, PreparedLaunch


@functools.lru_cache(maxsize=None)
def _constexpr_names(fn) -> frozenset[str]:
    py = getattr(fn, "fn", fn)
    return frozenset(name for name, p in inspect.signature(py).parameters.items()
                     if "constexpr" in str(p.annotation))


def variant_key(launcher: CachedLauncher, args: tuple, options: tuple) -> tuple:
    py = getattr(launcher.fn, "fn", launcher.fn)
    const = _constexpr_names(launcher.fn)
    return (py.__name__, options,
            tuple((n, a) for n, a in zip(launcher.names, args) if n in const),
            tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))


class LaunchSpy:
    """``with spy.phase("warm-up"): ...`` fills ``spy.variants["warm-up"]``."""

    def __init__(self, monkeypatch) -> None:
        self.variants: dict[str, set[tuple]] = {}
        self._current: set[tuple] | None = None
        self._plans: dict[int, tuple] = {}
        self._kept: list[PreparedLaunch] = []  # so that no id is reused while the spy lives
        spy = self
        launch, prepare, repeat = CachedLauncher._launch, CachedLauncher.prepare, \
            PreparedLaunch.launch

        def _launch(self, grid, leading, num_warps, num_stages, launch_pdl, named):
            args = leading + tuple(named[n] for n in self.names[len(leading):])
            spy._record(variant_key(self, args, (num_warps, num_stages, launch_pdl)))
            return launch(self, grid, leading, num_warps, num_stages, launch_pdl, named)

        def _prepare(self, grid, *leading, lead=None, num_warps, num_stages=None,
                     launch_pdl=False, **named):
            plan = prepare(self, grid, *leading, lead=lead, num_warps=num_warps,
                           num_stages=num_stages, launch_pdl=launch_pdl, **named)
            args = leading + tuple(named[n] for n in self.names[len(leading):])
            spy._plans[id(plan)] = variant_key(self, args, (num_warps, num_stages, launch_pdl))
            spy._kept.append(plan)
            return plan

        def _repeat(self, stream, *leading):
            spy._record(spy._plans.get(id(self), ("a launch prepared before the spy",)))
            return repeat(self, stream, *leading)

        monkeypatch.setattr(CachedLauncher, "_launch", _launch)
        monkeypatch.setattr(CachedLauncher, "prepare", _prepare)
        monkeypatch.setattr(PreparedLaunch, "launch", _repeat)

    def _record(self, key: tuple) -> None:
        if self._current is not None:
            self._current.add(key)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[set[tuple]]:
        self._current = self.variants.setdefault(name, set())
        try:
            yield self._current
        finally:
            self._current = None
