"""Adapter slot rotation's policy (``kernels.vllm.scheduling.slot_policy``), without vLLM."""

from __future__ import annotations

import pytest

from kernels.vllm.scheduling.slot_policy import SlotRotation


def test_no_rotation_while_a_slot_is_free_or_nothing_waits():
    r = SlotRotation(quantum_s=1.0)
    r.observe(held=[1, 2], blocked=[3], now=0.0)
    assert r.yielding(slots=3, now=10.0) is None  # a free slot: vLLM admits adapter 3 itself
    r.observe(held=[1, 2, 3], blocked=[], now=10.0)
    assert r.yielding(slots=3, now=20.0) is None  # every slot held, nothing blocked


def test_the_longest_holder_yields_after_a_quantum_and_not_before():
    r = SlotRotation(quantum_s=1.0)
    r.observe(held=[1], blocked=[], now=0.0)
    r.observe(held=[1, 2], blocked=[3, 0], now=0.5)  # 0 (the base model) never needs a slot
    assert r.blocked_since == {3: 0.5}
    assert r.yielding(slots=2, now=0.9) is None
    assert r.yielding(slots=2, now=1.0) == 1
    r.yielded(1, now=1.0)
    assert 1 not in r.held_since and r.blocked_since[1] == 1.0 and r.rotations == 1


def test_rotation_goes_round_robin_over_the_adapters_in_demand():
    """Four adapters over two slots, one step every 0.1 s: each takes a slot in turn; the blocked
    adapter that waited longest is the one the scheduler admits (queue order), simulated here."""
    r, slots, held, order = SlotRotation(quantum_s=0.5), 2, [1, 2], []
    waiting = [3, 4]
    for step in range(60):
        now = step * 0.1
        r.observe(held=held, blocked=waiting, now=now)
        out = r.yielding(slots, now)
        if out is not None:
            r.yielded(out, now)
            held.remove(out)
            held.append(waiting.pop(0))  # the first blocked adapter in the queue takes the slot
            waiting.append(out)  # the yielding adapter's requests rejoin at the queue's end
            order.append(out)
    assert order[:6] == [1, 2, 3, 4, 1, 2]
    # each adapter held its slot at least a quantum (0.5 s) between yields, and no longer than a
    # quantum and a step: per slot at most 6.0 / 0.5 rotations, at least (6.0 - 0.5) / 0.6
    assert 2 * 9 <= r.rotations <= 2 * 12


def test_the_freed_slot_goes_to_the_adapter_blocked_longest():
    r = SlotRotation(quantum_s=1.0)
    r.observe(held=[1, 2], blocked=[4], now=0.0)
    r.observe(held=[1, 2], blocked=[4, 3], now=0.5)
    assert r.yielding(slots=2, now=1.0) == 1
    assert r.taker(1) == 4  # blocked since 0.0, 3 only since 0.5
    r.yielded(1, now=1.0)
    r.observe(held=[2, 4], blocked=[3, 1], now=1.1)
    assert r.yielding(slots=2, now=1.1) == 2 and r.taker(2) == 3  # then 1, which yielded last
    r.yielded(2, now=1.1)
    r.observe(held=[4, 3], blocked=[2, 1], now=1.2)
    assert r.taker(4) == 1  # blocked since 1.0, 2 since 1.1
    r.blocked_since.clear()
    assert r.taker(1) is None


def test_a_held_adapter_keeps_its_start_while_held_and_restarts_after_a_break():
    r = SlotRotation(quantum_s=1.0)
    r.observe(held=[1, 2], blocked=[], now=0.0)
    r.observe(held=[2], blocked=[], now=0.5)  # 1's requests ended
    r.observe(held=[1, 2], blocked=[3], now=0.6)  # 1 is back: its quantum starts again
    assert r.yielding(slots=2, now=1.0) == 2  # 2 held since 0.0
    assert r.held_since[1] == 0.6


def test_a_quantum_must_be_positive():
    with pytest.raises(ValueError):
        SlotRotation(quantum_s=0)
