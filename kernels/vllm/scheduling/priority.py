"""Batch slots that follow request priorities.

With ``scheduling_policy="priority"`` vLLM orders its waiting queue by ``(priority, arrival)``
but preempts a running request only when the KV cache runs out: once ``max_num_seqs`` requests
run, a waiting request of better priority waits until one of them ends, however long that
takes. This rule runs before each step: while the batch is full and the best waiting request's
priority is lower (better) than the worst running one's by more than ``preempt_margin``
(priority units; the app's fair share uses virtual tokens), the worst running request is
preempted — at most one per step, so the batch comes to hold the best priorities. A waiting
request that could not join the batch anyway (its adapter would exceed ``max_loras``, or it is
not ready) preempts nothing.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.request_queue import SchedulingPolicy

from .requests import WAITING_STATES, can_preempt, lora_id, preempt, waiting_queues

logger = logging.getLogger(__name__)


class PreemptForPriority:
    """The rule of the module doc, mixed into vLLM's ``Scheduler`` / ``AsyncScheduler``."""

    preempt_margin: int = 0
    priority_preemptions: int = 0  # preemptions this rule made

    def schedule(self, *args, **kwargs):
        if self.policy == SchedulingPolicy.PRIORITY:
            self._preempt_for_waiting()
        return super().schedule(*args, **kwargs)

    def _preempt_for_waiting(self) -> None:
        heads = [q.peek_request() for q in waiting_queues(self) if q]
        if len(self.running) < self.max_num_running_reqs or not heads:
            return
        head = min(heads)  # vLLM's Request orders by (priority, arrival)
        if head.status not in WAITING_STATES:
            return
        victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        if victim.priority - head.priority <= self.preempt_margin:
            return
        if not self._adapter_fits(head, victim) or not can_preempt(self, victim):
            return
        preempt(self, victim)
        self.priority_preemptions += 1
        logger.debug("preempted %s (priority %d) for %s (priority %d)", victim.request_id,
                     victim.priority, head.request_id, head.priority)

    def _adapter_fits(self, head, victim) -> bool:
        """Whether ``head`` could join the batch once ``victim`` leaves it (``max_loras``)."""
        lora_config = getattr(self, "lora_config", None)
        head_lora = lora_id(head)
        if lora_config is None or not head_lora:
            return True
        loras = {lora_id(r) for r in self.running if r is not victim} - {0}
        return head_lora in loras or len(loras) < lora_config.max_loras
