"""Running Triton kernels in tests without a GPU: the Triton interpreter.

The interpreter needs ``TRITON_INTERPRET=1`` when triton is first imported in the process (its
standard library is decorated then), when a kernel is defined (``@triton.jit`` reads it) and
while kernels run. ``import_triton_for_the_session`` (tests/conftest.py, before any test module
is imported) imports triton under it once; ``interpreter_unless_cuda`` sets it around a test
module's imports and the ``interpreter_when_no_gpu`` fixture around each test, restoring it
after, so other tests (and the engine processes they start) never see it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def in_process_ok() -> bool:
    """Whether Triton kernels can run in this process: a GPU, or triton not imported yet, or
    imported under the interpreter (its standard library decorated for it)."""
    if HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
        return True
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def import_triton_for_the_session() -> None:
    """Without a GPU: imports triton under the interpreter, then checks that kernels can run in
    this process; raises (the session cannot test its kernels) when triton came in earlier
    without it."""
    if HAS_CUDA:
        return
    with interpreter_unless_cuda():
        import triton.language  # noqa: F401
    if not in_process_ok():
        raise RuntimeError("triton was imported before the test session could set up its "
                           "interpreter: the Triton kernels cannot be tested in this process")


@contextlib.contextmanager
def interpreter_unless_cuda():
    """``TRITON_INTERPRET=1`` for the block when there is no GPU; restored after."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture
def interpreter_when_no_gpu(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error in float64."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
