"""``kernels.launch.cached.CachedLauncher``: the variant key follows what Triton specialises on,
and a known variant is launched through its compiled launcher with every argument in order."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.launch.cached import CachedLauncher


def fake_jit(calls: list):
    params = [SimpleNamespace(is_constexpr=False, do_not_specialize=False),  # x_ptr
              SimpleNamespace(is_constexpr=False, do_not_specialize=False),  # n (specialised)
              SimpleNamespace(is_constexpr=False, do_not_specialize=True),   # m (not)
              SimpleNamespace(is_constexpr=True, do_not_specialize=False)]   # BM

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            calls.append(("fast", a))

    class Fn:
        arg_names = ["x_ptr", "n", "m", "BM"]

        def __init__(self):
            self.params = params

        def __getitem__(self, grid):
            def launch(*args, **options):
                calls.append(("triton", grid, args, options))
                return Compiled()
            return launch
    return Fn()


def test_key_separates_what_triton_specialises_on():
    launcher = CachedLauncher(fake_jit([]))
    x = torch.zeros(64, dtype=torch.float32)
    k = launcher._key((x, 32, 5, 16), (4, None, False))
    assert launcher._key((x, 32, 7_000_000, 16), (4, None, False)) == k  # m not specialised
    assert launcher._key((x, 32, 2**40, 16), (4, None, False)) != k  # ... but its int width is
    assert launcher._key((x, 48, 5, 16), (4, None, False)) != k  # n is
    assert launcher._key((x, 32, 5, 32), (4, None, False)) != k  # constexpr
    assert launcher._key((x[1:], 32, 5, 16), (4, None, False)) != k  # 16-byte alignment
    assert launcher._key((x.half(), 32, 5, 16), (4, None, False)) != k  # dtype
    assert launcher._key((x, 32, 5, 16), (8, None, False)) != k  # launch options
    assert launcher._key((x, 32, 5, 16), (4, None, True)) != k


def test_first_launch_through_triton_then_fast_path_with_all_arguments(monkeypatch):
    # the fast path launches on the current CUDA stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    calls: list = []
    launcher = CachedLauncher(fake_jit(calls))
    x = torch.zeros(8)
    launcher((3, 2), x, 32, m=5, BM=16, num_warps=4, launch_pdl=True)
    launcher((9,), x, 32, m=6, BM=16, num_warps=4, launch_pdl=True)
    assert calls[0] == ("triton", (3, 2), (x, 32, 5, 16), {"num_warps": 4, "launch_pdl": True})
    kind, args = calls[1]
    assert kind == "fast" and args[:3] == (9, 1, 1) and args[4:9] == ("fn", "meta", None, None,
                                                                     None)
    assert args[9:12] == (x, 32, 6) and args[12] == 16
    launcher((9,), x, 33, m=6, BM=16, num_warps=4, launch_pdl=True)  # new variant: Triton
    assert calls[2][0] == "triton"


def test_prepared_launch_replaces_leading_arguments_and_calls_the_compiled_launcher():
    calls: list = []
    launcher = CachedLauncher(fake_jit(calls))
    x, x2 = torch.zeros(8), torch.ones(8)
    plan = launcher.prepare((3, 2), x, 32, m=5, BM=16, num_warps=4)
    assert calls.pop(0)[0] == "triton"  # prepare launches once, through Triton
    assert plan.tail == (5, 16)  # by default the positional arguments are given anew
    plan.launch(7, x2, 32)  # Triton's launcher class without its C entry point: ``run``
    kind, args = calls.pop(0)
    assert kind == "fast" and args[:4] == (3, 2, 1, 7) and args[4:9] == ("fn", "meta", None,
                                                                       None, None)
    assert args[9:] == (x2, 32, 5, 16)

    class CRun:  # with the C entry point and no scratch: called straight
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *a):
            calls.append(("c", a))

    kernel = SimpleNamespace(run=CRun(), function="fn", packed_metadata="meta")
    from kernels.launch.cached import PreparedLaunch

    plan = PreparedLaunch(None, (5,), (x, 32, 5, 16), None, kernel, lead=2)
    assert plan.tail == (5, 16)  # nothing of the call (its tensors) is kept
    plan.launch(9, x2, 33)
    kind, args = calls.pop(0)
    assert kind == "c" and args[:4] == (5, 1, 1, 9)
    assert args[4:13] == ("fn", False, True, None, None, "meta", None, None, None)
    assert args[13:] == (x2, 33, 5, 16)


def test_prepared_launch_under_the_interpreter_takes_the_normal_path():
    calls: list = []
    fn = fake_jit(calls)
    fn.params = None  # what the interpreter's function looks like to the launcher
    launcher = CachedLauncher(fn)
    x, x2 = torch.zeros(8), torch.ones(8)
    plan = launcher.prepare((3,), x, 32, m=5, BM=16, num_warps=4, lead=1)
    plan.launch(0, x2)
    assert [c[0] for c in calls] == ["triton", "triton"]
    assert calls[1][2] == (x2, 32, 5, 16) and calls[1][3] == {"num_warps": 4}
