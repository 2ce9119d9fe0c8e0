"""loraplex's vLLM schedulers (engine argument ``scheduler_cls`` = ``SCHEDULER``): vLLM's own,
with two rules applied before each step —

- ``priority``: a full batch's worst-priority request gives its place to a waiting request that
  leads it by a margin (fair share inside the batch, under ``scheduling_policy="priority"``);
- ``slot_rotation``: with more adapters in demand than GPU LoRA slots, the adapter that has held
  its slot for a quantum yields it (policy in ``slot_policy``).

Their settings travel in vLLM's ``additional_config`` under ``SETTINGS_KEY`` (``SchedulerSettings``),
so the engine-core process gets them with the rest of the engine's configuration.
``build_scheduler`` is what the engine core calls in place of a scheduler class: it builds the
synchronous or the asynchronous variant, as vLLM resolved ``async_scheduling``. vLLM releases:
those of ``kernels.vllm.versions`` whose scheduler has ``_preempt_request``; checked when the
scheduler is built in the engine-core process.
"""

from __future__ import annotations

from .settings import SETTINGS_KEY, SchedulerSettings, settings_of

SCHEDULER = "kernels.vllm.scheduling.build_scheduler"
__all__ = ["SCHEDULER", "SETTINGS_KEY", "SchedulerSettings", "build_scheduler", "settings_of"]


def build_scheduler(*, vllm_config, **kwargs):
    """vLLM's scheduler constructor signature; the variant matching ``async_scheduling``."""
    from .schedulers import LoraplexAsyncScheduler, LoraplexScheduler

    cls = LoraplexAsyncScheduler if vllm_config.scheduler_config.async_scheduling else LoraplexScheduler
    return cls(vllm_config=vllm_config, settings=settings_of(vllm_config), **kwargs)
