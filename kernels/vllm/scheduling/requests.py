"""What both scheduling rules need of vLLM's ``Request`` and ``Scheduler``: a request's adapter
and one preemption done as vLLM's own is (``_preempt_request``, back to the waiting queue)."""

from __future__ import annotations

import time

from vllm.v1.request import RequestStatus

WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def lora_id(request) -> int:
    """The request's adapter id in the engine (0: the base model)."""
    lora = getattr(request, "lora_request", None)
    return lora.lora_int_id if lora is not None and lora.lora_int_id > 0 else 0


def waiting_queues(scheduler) -> list:
    """The queues whose requests wait to be scheduled: ``waiting`` and, in vLLM 0.24,
    ``skipped_waiting``, where a step leaves the requests it skipped (e.g. for ``max_loras``) and
    which the next step serves first; vLLM 0.32 puts skipped requests back into ``waiting``."""
    return [q for q in (scheduler.waiting, getattr(scheduler, "skipped_waiting", None)) if q is not None]


def waiting_requests(scheduler) -> list:
    """Every request of ``waiting_queues``."""
    return [r for q in waiting_queues(scheduler) for r in q]


def can_preempt(scheduler, request) -> bool:
    """Whether ``request`` runs and its blocks may be freed now (vLLM's own check, where it has one)."""
    if request.status != RequestStatus.RUNNING:
        return False
    check = getattr(scheduler, "_request_blocks_can_be_freed", None)
    return check is None or check(request)


def preempt(scheduler, request) -> None:
    """Takes a running ``request`` out of the batch back to the waiting queue; vLLM recomputes
    its KV when it resumes (prefix caching keeps the computed blocks while memory allows)."""
    scheduler.running.remove(request)
    if getattr(scheduler, "requires_kv_delivery", False):  # as vLLM's own preemption does
        scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)
    else:
        scheduler._preempt_request(request, time.monotonic())
