"""Slot rotation's queue handling (``kernels.vllm.scheduling.slot_rotation``) on vLLM's own
``Request`` and request queues, under both queue layouts the supported releases have: vLLM 0.32
puts a step's skipped requests back into ``waiting``; vLLM 0.24 keeps them in ``skipped_waiting``,
served first. The scheduler underneath is reduced to what the rule touches (the real engine runs
it in tests/serving/test_engine_slot_rotation.py, on the installed release's layout only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.request import Request, RequestStatus

from kernels.vllm.scheduling.slot_policy import SlotRotation
from kernels.vllm.scheduling.slot_rotation import RotateAdapterSlots


class _Step:
    """vLLM's ``schedule`` reduced to recording which requests were waiting where."""

    def schedule(self):
        return {"waiting": [r.request_id for r in self.waiting],
                "skipped": [r.request_id for r in getattr(self, "skipped_waiting", [])]}

    def _preempt_request(self, request, timestamp):  # what vLLM's does to the queues and the status
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend_request(request)


class _Scheduler(RotateAdapterSlots, _Step):
    def __init__(self, skipped_layout: bool, max_loras: int = 1):
        self.policy = SchedulingPolicy.FCFS
        self.lora_config = SimpleNamespace(max_loras=max_loras)
        self.running, self.waiting = [], create_request_queue(self.policy)
        if skipped_layout:
            self.skipped_waiting = create_request_queue(self.policy)
        self.slot_rotation = SlotRotation(quantum_s=1e-9)


def _request(rid: str, adapter: int, arrival: float) -> Request:
    """A request of ``adapter`` (0: the base model)."""
    lora = LoRARequest(f"a{adapter}", adapter, "/nonexistent") if adapter else None
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8), None, arrival_time=arrival, lora_request=lora)


@pytest.mark.parametrize("skipped_layout", [False, True], ids=["vllm-0.32-layout", "vllm-0.24-layout"])
def test_the_holder_yields_and_its_requests_stay_out_for_one_step(skipped_layout):
    s = _Scheduler(skipped_layout)
    a1, a2, b = _request("a1", 1, 0.0), _request("a2", 1, 0.1), _request("b", 2, 0.2)
    a1.status = RequestStatus.RUNNING
    s.running.append(a1)
    a2.status = b.status = RequestStatus.WAITING
    blocked_queue = s.skipped_waiting if skipped_layout else s.waiting  # where a skipped request sits
    blocked_queue.add_request(a2)  # adapter 1's second request, waiting
    blocked_queue.add_request(b)  # adapter 2, blocked by max_loras = 1
    s.schedule()  # first sight: both held and blocked adapters start their clocks
    seen = s.schedule()  # a quantum later: adapter 1 yields
    assert s.running == [] and a1.status == RequestStatus.PREEMPTED
    assert seen == {"waiting": [], "skipped": ["b"]} if skipped_layout else seen == {"waiting": ["b"], "skipped": []}
    # after the step adapter 1's requests wait again, behind b, in arrival order
    assert [r.request_id for r in s.waiting] == (["a1", "a2"] if skipped_layout else ["b", "a1", "a2"])
    assert s.slot_rotation.rotations == 1


@pytest.mark.parametrize("policy", [SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY])
@pytest.mark.parametrize("skipped_layout", [False, True], ids=["vllm-0.32-layout", "vllm-0.24-layout"])
def test_the_freed_slot_goes_to_the_adapter_blocked_longest_whatever_the_queue_order(skipped_layout, policy):
    """Adapter 3 was blocked first; adapter 2's request comes first in the queue (earlier arrival,
    better priority). The step after adapter 1 yields sees adapter 3's request only (and the base
    model's), so 3 takes the slot; 2 and 1 rejoin after the step."""
    s = _Scheduler(skipped_layout)
    s.policy = policy
    s.waiting = create_request_queue(policy)
    if skipped_layout:
        s.skipped_waiting = create_request_queue(policy)
    held, late, early, base = (_request("held", 1, 0.0), _request("late", 2, 0.1), _request("early", 3, 0.3),
                               _request("base", 0, 0.4))
    late.priority = -5  # the queue's order would pick adapter 2
    held.status = RequestStatus.RUNNING
    s.running.append(held)
    queue = s.skipped_waiting if skipped_layout else s.waiting
    early.status = late.status = base.status = RequestStatus.WAITING
    queue.add_request(early)
    s.schedule()  # adapter 3 blocked from here
    queue.add_request(late)
    s.waiting.add_request(base)
    seen = s.schedule()  # adapter 1 yields: its slot goes to 3
    assert held.status == RequestStatus.PREEMPTED and s.slot_rotation.rotations == 1
    assert sorted(seen["waiting"] + seen["skipped"]) == ["base", "early"]
    after = sorted(r.request_id for q in (s.waiting, getattr(s, "skipped_waiting", [])) for r in q)
    assert after == ["base", "early", "held", "late"]  # nothing lost: all wait again after the step


def test_nothing_yields_while_nothing_is_blocked():
    s = _Scheduler(skipped_layout=True, max_loras=2)
    a, b = _request("a", 1, 0.0), _request("b", 2, 0.1)
    for r in (a, b):
        r.status = RequestStatus.RUNNING
        s.running.append(r)
    s.schedule()
    s.schedule()
    assert s.running == [a, b] and s.slot_rotation.rotations == 0
