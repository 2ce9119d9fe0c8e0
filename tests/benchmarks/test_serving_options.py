"""benchmarks/serving.py's per-server options of loraplex servers."""

from __future__ import annotations

import pytest

from benchmarks.serving import engine_overrides


def test_engine_settings_go_to_the_named_loraplex_server_only():
    kinds = ["vllm", "loraplex", "rot-on"]  # rot-on: a --loraplex-checkout server
    out = engine_overrides(["loraplex=max_loras=2", "rot-on=max_loras=2", "rot-on=slot_quantum_s=0.5",
                            "rot-on=enable_prefix_caching=false"], kinds)
    assert out == {"loraplex": {"max_loras": 2},
                   "rot-on": {"max_loras": 2, "slot_quantum_s": 0.5,
                              "extra_engine_args": {"enable_prefix_caching": False}}}


@pytest.mark.parametrize("spec", ["vllm=max_loras=2", "other=max_loras=2", "loraplex=max_loras", "loraplex"])
def test_a_setting_for_no_loraplex_server_or_without_a_value_is_refused(spec):
    with pytest.raises(SystemExit, match="--loraplex-engine"):
        engine_overrides([spec], ["vllm", "loraplex"])
