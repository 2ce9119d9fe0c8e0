"""The bookkeeping of adapter loads prepared off the engine's loop (``kernels.vllm.lora_loads``):
a failed preparation is dropped when reported, so ``add_lora`` loads the adapter itself; a
preparation nobody takes is discarded; an adapter already registered is not prepared again. (The
prepared path serving tokens is ``tests/serving/test_engine_adapter_loads.py``.)"""

from __future__ import annotations

import threading
import time

import pytest

from kernels.vllm import lora_loads
from kernels.vllm.patching import Patches


class _Manager:
    """What ``prepare`` itself asks of vLLM's ``WorkerLoRAManager``: its registered ids. vLLM's
    loader, run on it in the preparing thread, fails (no LoRA manager behind it), as it would on a
    broken adapter: the failure path."""

    def __init__(self, registered=()):
        self.registered = set(registered)

    def list_adapters(self):
        return self.registered


@pytest.fixture
def installed():
    """A wrap of its own, over the CPU path's where that is installed in this process already
    (two wrappers of ``_load_adapter``: the preparing thread must pass through both)."""
    previous = lora_loads._original_load
    patches = Patches("test lora loads")
    lora_loads.install(patches)
    yield
    patches.undo()
    with lora_loads._lock:
        lora_loads._prepared.clear()
    lora_loads._original_load = previous


def _request(i: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"a{i}", lora_int_id=i, lora_path="/nonexistent/adapter")


def _wait_ready(i: int) -> None:
    deadline = time.monotonic() + 30
    while not lora_loads.ready(i):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failed_preparation_is_dropped_when_reported(installed):
    assert lora_loads.prepare(_Manager(), _request(1), threads=0)
    assert not lora_loads.prepare(_Manager(), _request(1), threads=0)  # one at a time per adapter
    _wait_ready(1)
    assert lora_loads.held() == []  # add_lora now loads it itself and raises vLLM's own error


def test_registered_adapters_are_not_prepared_and_unknown_ids_are_ready(installed):
    assert not lora_loads.prepare(_Manager(registered={2}), _request(2), threads=0)
    assert lora_loads.held() == [] and lora_loads.ready(99)


def test_a_preparation_nobody_takes_is_discarded(installed):
    gate = threading.Event()
    original = lora_loads._original_load
    lora_loads._original_load = lambda manager, request: gate.wait(30) and original(manager, request)
    try:
        assert lora_loads.prepare(_Manager(), _request(3), threads=0)
        assert lora_loads.held() == [3] and not lora_loads.ready(3)
        assert lora_loads.discard(3) and lora_loads.held() == [] and not lora_loads.discard(3)
    finally:
        gate.set()
        lora_loads._original_load = original


def test_prepare_refuses_where_the_loads_are_not_installed(monkeypatch):
    monkeypatch.setattr(lora_loads, "_original_load", None)
    with pytest.raises(RuntimeError, match="not installed"):
        lora_loads.prepare(_Manager(), _request(4), threads=0)


def test_nested_wrappers_let_the_preparing_thread_load(installed):
    """With two wrappers installed, the preparation neither takes its own entry nor waits on itself."""
    outer = Patches("a second wrap")
    lora_loads.install(outer)
    try:
        for i in range(10, 20):
            assert lora_loads.prepare(_Manager(), _request(i), threads=0)
            assert not lora_loads.prepare(_Manager(), _request(i), threads=0)  # still held: nobody took it
            _wait_ready(i)
        assert lora_loads.held() == []
    finally:
        outer.undo()


def test_a_profiled_preparation_writes_its_profile(installed, monkeypatch, tmp_path):
    """``LORAPLEX_PROFILE_ADAPTER_LOADS``: the preparation (here one whose loader fails) leaves a
    readable profile naming vLLM's loader."""
    import pstats

    monkeypatch.setenv(lora_loads.PROFILE_ENV, str(tmp_path / "profiles"))
    assert lora_loads.prepare(_Manager(), _request(30), threads=0)
    _wait_ready(30)
    stats = pstats.Stats(str(tmp_path / "profiles" / "a30.pstats"))
    assert any(name == "_load_adapter" for _, _, name in stats.stats)


def test_one_preparation_is_profiled_at_a_time(installed, monkeypatch, tmp_path):
    """Two preparations at once with profiling on (a process-wide profile on Python 3.12): one is
    profiled, the other runs unprofiled instead of failing; a name's odd characters leave the file
    name."""
    monkeypatch.setenv(lora_loads.PROFILE_ENV, str(tmp_path / "profiles"))
    both = threading.Barrier(2, timeout=30)
    original = lora_loads._original_load

    def load(manager, request):
        both.wait()  # both preparations are running now
        return original(manager, request)

    monkeypatch.setattr(lora_loads, "_original_load", load)
    requests = [_request(40), _request(41)]
    requests[0].lora_name = "tenant/a40@v1"
    for r in requests:
        assert lora_loads.prepare(_Manager(), r, threads=0)
    for r in requests:
        _wait_ready(r.lora_int_id)
    assert len(list((tmp_path / "profiles").glob("*.pstats"))) == 1
    assert {p.name for p in (tmp_path / "profiles").iterdir()} <= {"tenant_a40_v1.pstats", "a41.pstats"}
