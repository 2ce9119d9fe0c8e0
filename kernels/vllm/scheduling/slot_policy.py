"""Which adapter yields its GPU LoRA slot (policy only: no vLLM here; ``slot_rotation`` applies it).

vLLM keeps ``max_loras`` adapters in a batch and lets a waiting request whose adapter is not
among them wait until every running request of some adapter has ended: with more adapters in
demand than slots, a request waits a whole generation (seconds), however short it is. Rotation
bounds that wait: once every slot is held and requests of another adapter wait, the adapter that
has held its slot longest yields it after holding it ``quantum_s`` — its requests go back to the
waiting queue behind the ones already there, and resume where they stopped when a slot comes
back to them — and the blocked adapter that has waited longest takes the freed slot (round robin
over the adapters in demand, one quantum each, whatever the queue's own order: under the
priority policy a blocked adapter's requests could otherwise be passed over again and again).

Invariants: an adapter yields only after holding its slot for ``quantum_s`` without a break; at
most one adapter yields per step; nothing yields while a slot is free or nothing is blocked.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotRotation:
    """Time each adapter has held a slot and each blocked adapter has waited, step by step."""

    def __init__(self, quantum_s: float) -> None:
        if quantum_s <= 0:
            raise ValueError(f"slot quantum must be > 0 s, got {quantum_s}")
        self.quantum_s = quantum_s
        self.held_since: dict[int, float] = {}
        self.blocked_since: dict[int, float] = {}
        self.rotations = 0

    def observe(self, held: Iterable[int], blocked: Iterable[int], now: float) -> None:
        """The adapters of the running requests (``held``) and of the waiting requests that are
        ready (``blocked``: those not held) at time ``now``; ids > 0 (0 is the base model)."""
        held = {a for a in held if a}
        self.held_since = {a: self.held_since.get(a, now) for a in held}
        self.blocked_since = {a: self.blocked_since.get(a, now) for a in blocked if a and a not in held}

    def yielding(self, slots: int, now: float) -> int | None:
        """The adapter to take out of the batch now, or None: the longest holder, once every one of
        ``slots`` is held, another adapter waits and it has held its slot for a quantum."""
        if len(self.held_since) < slots or not self.blocked_since:
            return None
        adapter, since = min(self.held_since.items(), key=lambda item: item[1])
        return adapter if now - since >= self.quantum_s else None

    def taker(self, yielding: int) -> int | None:
        """The blocked adapter that has waited longest (ties: the lowest id), other than
        ``yielding``: the one the slot ``yielding`` frees goes to."""
        waited = [(since, a) for a, since in self.blocked_since.items() if a != yielding]
        return min(waited)[1] if waited else None

    def yielded(self, adapter: int, now: float) -> None:
        """``adapter``'s requests left the batch at ``now``: it waits like any blocked adapter."""
        self.held_since.pop(adapter, None)
        self.blocked_since[adapter] = now
        self.rotations += 1
