"""vLLM schedulers whose batch slots follow request priorities (engine argument ``scheduler_cls``
= ``kernels.vllm.priority_scheduler.build_scheduler``).

With ``scheduling_policy="priority"`` vLLM orders its waiting queue by ``(priority, arrival)``
but preempts a running request only when the KV cache runs out: once ``max_num_seqs`` requests
run, a waiting request of better priority waits until one of them ends, however long that
takes. These subclasses add one rule before each step: while the batch is full and the best
waiting request's priority is lower (better) than the worst running one's by more than
``LORAPLEX_PREEMPT_MARGIN`` (priority units; the app's fair share uses virtual tokens), the worst
running request is preempted through vLLM's own ``_preempt_request`` (back to the waiting queue,
recomputed when it resumes; prefix caching keeps that cheap) — at most one per waiting request
that outranks, so the batch holds the best priorities. A waiting request that could not join
the batch anyway (its adapter would exceed ``max_loras``, or it is not ready) preempts nothing.

``build_scheduler`` is what vLLM's engine core calls in place of a scheduler class: it builds
the synchronous or the asynchronous variant, as vLLM's config resolved ``async_scheduling``.
vLLM releases: those of ``kernels.vllm.versions`` whose scheduler has ``_preempt_request``;
checked when the scheduler is built in the engine-core process.
"""

from __future__ import annotations

import logging
import os
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kernels.vllm.versions import UnsupportedVLLMError, require_any

MARGIN_ENV = "LORAPLEX_PREEMPT_MARGIN"
logger = logging.getLogger(__name__)


def margin_from_env() -> int:
    """Priority gap above which a waiting request takes a running one's slot (default 0)."""
    return int(os.environ.get(MARGIN_ENV, "0") or 0)


def _lora_id(request) -> int:
    lora = getattr(request, "lora_request", None)
    return lora.lora_int_id if lora is not None and lora.lora_int_id > 0 else 0


class _PreemptForPriority:
    """The rule of the module doc, mixed into vLLM's ``Scheduler`` / ``AsyncScheduler``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require_any("loraplex's priority-preempting scheduler")
        if not hasattr(self, "_preempt_request"):
            raise UnsupportedVLLMError("this vLLM's scheduler has no _preempt_request")
        self.preempt_margin = margin_from_env()
        self.priority_preemptions = 0

    def schedule(self, *args, **kwargs):
        if self.policy == SchedulingPolicy.PRIORITY:
            self._preempt_for_waiting()
        return super().schedule(*args, **kwargs)

    def _preempt_for_waiting(self) -> None:
        if len(self.running) < self.max_num_running_reqs or not self.waiting:
            return
        head = self.waiting.peek_request()
        if head.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return
        victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        if victim.priority - head.priority <= self.preempt_margin:
            return
        if not self._adapter_fits(head, victim) or victim.status != RequestStatus.RUNNING:
            return
        if hasattr(self, "_request_blocks_can_be_freed") and not self._request_blocks_can_be_freed(victim):
            return
        self.running.remove(victim)
        if getattr(self, "requires_kv_delivery", False):  # as vLLM's own preemption does
            self._preempt_request(victim, time.monotonic(), drop_stale_output=True)
        else:
            self._preempt_request(victim, time.monotonic())
        self.priority_preemptions += 1
        logger.debug("preempted %s (priority %d) for %s (priority %d)", victim.request_id,
                     victim.priority, head.request_id, head.priority)

    def _adapter_fits(self, head, victim) -> bool:
        """Whether ``head`` could join the batch once ``victim`` leaves it (``max_loras``)."""
        lora_config = getattr(self, "lora_config", None)
        head_lora = _lora_id(head)
        if lora_config is None or not head_lora:
            return True
        loras = {_lora_id(r) for r in self.running if r is not victim} - {0}
        return head_lora in loras or len(loras) < lora_config.max_loras


class PriorityPreemptingScheduler(_PreemptForPriority, Scheduler):
    """vLLM's synchronous scheduler with the rule of the module doc."""


class PriorityPreemptingAsyncScheduler(_PreemptForPriority, AsyncScheduler):
    """vLLM's async scheduler with the rule of the module doc."""


def build_scheduler(*, vllm_config, **kwargs):
    """vLLM's scheduler constructor signature; the variant matching ``async_scheduling``."""
    cls = PriorityPreemptingAsyncScheduler if vllm_config.scheduler_config.async_scheduling else PriorityPreemptingScheduler
    return cls(vllm_config=vllm_config, **kwargs)
