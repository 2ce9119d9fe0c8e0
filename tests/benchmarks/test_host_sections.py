"""``benchmarks.profiling.host_sections``: named functions timed while active (calls and host time,
nested sections included in their callers'), restored on exit; targets a stack lacks are
left out."""

from __future__ import annotations

import time
import types

from benchmarks.profiling.host_sections import HostSections, mxfp4_engine_sections


class Layer:
    def apply(self, n):
        time.sleep(0.002)
        return helpers.inner(n) + 1


helpers = types.ModuleType("helpers")
helpers.inner = lambda n: (time.sleep(0.001), n * 2)[1]


def test_sections_time_calls_nest_and_restore():
    apply, inner = Layer.apply, helpers.inner
    targets = [("apply", Layer, "apply"), ("inner", helpers, "inner"),
               ("absent", Layer, "forward"), ("no module", None, "x")]
    with HostSections(targets) as s:
        assert Layer.apply is not apply and helpers.inner is not inner
        assert [Layer().apply(i) for i in range(3)] == [1, 3, 5]
    assert Layer.apply is apply and helpers.inner is inner
    assert dict(s.calls) == {"apply": 3, "inner": 3}
    assert s.ms["inner"] >= 3 * 1.0 and s.ms["apply"] >= s.ms["inner"] + 3 * 2.0
    per = s.per_step(3)
    assert per["apply"]["calls"] == 1 and abs(per["apply"]["ms"] - s.ms["apply"] / 3) < 1e-9


def test_a_failing_call_is_timed_and_the_wrapper_removed():
    class Boom:
        def run(self):
            raise ValueError("bad input")

    with HostSections([("run", Boom, "run")]) as s:
        try:
            Boom().run()
        except ValueError:
            pass
    assert s.calls["run"] == 1 and "run" in vars(Boom) and Boom.run.__name__ == "run"


def test_engine_sections_name_only_what_this_stack_has():
    for label, owner, attr in mxfp4_engine_sections():
        assert isinstance(label, str)
        assert owner is None or hasattr(owner, attr) or attr == "__call__"
    labels = {label for label, owner, _ in mxfp4_engine_sections() if owner is not None}
    assert "LoRA gate_up (loraplex)" in labels and "LoRA mapping (per step)" in labels
