"""Adapter slot rotation in vLLM's scheduler (the policy: ``slot_policy``).

Before each step the running and ready waiting requests' adapters go to ``SlotRotation``; when
it names an adapter to yield, every running request of that adapter is preempted through
vLLM's ``_preempt_request``, and for this step the waiting requests of that adapter and of every
other blocked adapter but the policy's taker (the one blocked longest) are held out of the
waiting queues, so the freed slot goes to the taker: not straight back, and not to whichever
blocked request the queue's order puts first. After the step they rejoin the waiting queue: at
its end first come, first served, by their own priority under the priority policy. Requests of
the base model and of adapters in a slot are never held out.
"""

from __future__ import annotations

import logging
import time

from vllm.v1.core.sched.request_queue import SchedulingPolicy

from .requests import WAITING_STATES, can_preempt, lora_id, preempt, waiting_queues, waiting_requests
from .slot_policy import SlotRotation

logger = logging.getLogger(__name__)


class RotateAdapterSlots:
    """The rotation of the module doc, mixed into vLLM's ``Scheduler`` / ``AsyncScheduler``;
    ``slot_rotation`` is None when it is off."""

    slot_rotation: SlotRotation | None = None

    def schedule(self, *args, **kwargs):
        held_out = self._rotate_slots() if self.slot_rotation is not None and self.lora_config else []
        try:
            return super().schedule(*args, **kwargs)
        finally:
            for request in held_out:
                self.waiting.add_request(request)

    def _rotate_slots(self) -> list:
        now = time.monotonic()
        rotation = self.slot_rotation
        slots = self.lora_config.max_loras
        held = {lora_id(r) for r in self.running} - {0}
        # a waiting adapter is blocked only while every slot is held: scan the queues only then
        blocked = ({lora_id(r) for r in waiting_requests(self) if r.status in WAITING_STATES}
                   if len(held) >= slots else ())
        rotation.observe(held, blocked, now)
        adapter = rotation.yielding(slots, now)
        if adapter is None:
            return []
        held_s = now - rotation.held_since[adapter]
        leaving = [r for r in self.running if lora_id(r) == adapter]
        if not all(can_preempt(self, r) for r in leaving):
            return []
        for r in leaving:
            preempt(self, r)
        taker = rotation.taker(adapter)
        rotation.yielded(adapter, now)
        hold = set(rotation.blocked_since) - {taker}  # the yielding adapter is blocked now
        held_out = []
        for queue in waiting_queues(self):
            mine = [r for r in queue if lora_id(r) in hold]
            queue.remove_requests(mine)
            held_out += mine
        if self.policy == SchedulingPolicy.FCFS:
            held_out.sort(key=lambda r: r.arrival_time)
        logger.debug("adapter %d yielded its slot to adapter %s after %.2f s: %d requests preempted", adapter,
                     taker, held_s, len(leaving))
        return held_out
