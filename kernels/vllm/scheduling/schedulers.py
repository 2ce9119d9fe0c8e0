"""vLLM's synchronous and asynchronous schedulers with loraplex's rules (``priority`` first,
then ``slot_rotation``, then vLLM's own step)."""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kernels.vllm.versions import UnsupportedVLLMError, require_any

from .settings import SchedulerSettings
from .priority import PreemptForPriority
from .slot_policy import SlotRotation
from .slot_rotation import RotateAdapterSlots


class _LoraplexRules(PreemptForPriority, RotateAdapterSlots):
    def __init__(self, *args, settings: SchedulerSettings, **kwargs):
        super().__init__(*args, **kwargs)
        require_any("loraplex's scheduler")
        if not hasattr(self, "_preempt_request"):
            raise UnsupportedVLLMError("this vLLM's scheduler has no _preempt_request")
        self.preempt_margin = settings.preempt_margin
        if settings.slot_quantum_s is not None:
            self.slot_rotation = SlotRotation(settings.slot_quantum_s)


class LoraplexScheduler(_LoraplexRules, Scheduler):
    """vLLM's synchronous scheduler with loraplex's rules."""


class LoraplexAsyncScheduler(_LoraplexRules, AsyncScheduler):
    """vLLM's async scheduler with loraplex's rules."""
