"""Compile every MoE-LoRA kernel variant before vLLM serves, and report any compiled later.

Triton compiles a kernel variant at its first launch; a compile while serving stalls the whole
engine step (hundreds of ms: every request in the batch waits). ``warm_up_layer`` runs when
vLLM sets up a MoE layer's LoRA (``set_mapping``, at model load: before the profile run, graph
capture and any request), once per layer shape and process; the first MoE-LoRA call repeats the
check before its "no adapter in this batch" exit in case the setup hook did not run. It never
runs under CUDA-graph capture. Its scratch memory is returned to the device afterwards so vLLM's
memory profiling does not count it.

``watch_compiles`` chains Triton's pre- and post-compile hooks: once the warm-up is done, every
further compile of one of loraplex's kernels is logged as a warning with its specialisation key
and duration (and counted in ``COMPILES_DURING_SERVING``), so a variant the warm-up missed shows
in the engine's log; every other Triton kernel compiled from then on (vLLM's, triton_kernels'
``matmul_ogs`` variants, chosen per batch size) is logged too, at info level with its duration
(``OTHER_COMPILES``): a stall in serving can then be told apart from a compile.

Logs go to the ``vllm.loraplex`` logger so that they appear in vLLM's own log output.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from kernels.vllm.patching import ObjectMap

WARM_UP_MS = (1, 4, 16, 64, 256, 1024, 4096)
OUR_KERNELS = ("_moe_lora_shrink_kernel", "_moe_lora_expand_kernel", "_moe_lora_align_kernel",
               "_moe_lora_count_kernel", "_moe_lora_place_kernel", "_dense_lora_shrink_kernel",
               "_dense_lora_expand_kernel", "_routing_inputs_kernel",
               "_swiglu_rows_without_lora_kernel")
COMPILES_DURING_SERVING: list[str] = []
OTHER_COMPILES: list[tuple[str, float, str]] = []  # (kernel, seconds, key) compiled after the warm-up
_warmed: set[tuple] = set()
_done: list[bool] = []  # a warm-up has finished in this process
_done_contexts: ObjectMap[bool] = ObjectMap()  # the layers' LoRA contexts whose shape is warmed up
_watching = False
_warming = False


def vllm_logger() -> logging.Logger:
    """The ``vllm.loraplex`` logger, fetched per use and re-enabled: vLLM's logging setup
    (``dictConfig``) disables loggers that exist before it runs, which is the case when vLLM
    loads this plugin first thing in a freshly started engine process."""
    log = logging.getLogger("vllm.loraplex")
    log.disabled = False
    return log


def warm_up_layer(ctx, top_k: int, mxfp4: bool = False) -> None:
    """Compiles every kernel variant the tuned (or default) configs of this layer shape can
    launch (``mxfp4``: those of the unfused MXFP4 experts instead — rows through a row map,
    GPT-OSS's activation folded into gate_up); once per shape and process, never during
    CUDA-graph capture."""
    if ctx in _done_contexts:  # the per-step path: one lookup
        return
    from kernels.moe_lora.configs import (
        get_layer_config,
        tuned_layer_configs,
        untuned_ms,
    )
    from kernels.moe_lora.ops import warm_up

    a13 = ctx.w13_lora_a_stacked
    key = (tuple(a13[0].shape), len(a13), tuple(ctx.w2_lora_a_stacked[0].shape), top_k,
           a13[0].dtype, a13[0].device, mxfp4)
    if key in _warmed:
        _done_contexts[ctx] = True
        return
    if a13[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return
    shape = dict(hidden=a13[0].shape[-1], intermediate=ctx.w2_lora_a_stacked[0].shape[-1],
                 num_experts=ctx.local_num_experts, top_k=top_k, rank=a13[0].shape[-2],
                 num_slots=ctx.max_loras, device=a13[0].device)
    tuned = tuned_layer_configs(**shape)  # and the heuristic beyond the tuned batch sizes
    configs = tuned + [(m, get_layer_config(m, **shape))
                       for m in untuned_ms([m for m, _ in tuned], WARM_UP_MS)]
    from kernels.vllm.cuda import live

    with compiling_on_purpose():  # the variants serving launches: slot ranks where tracked
        warm_up(a13, ctx.w13_lora_b_stacked, ctx.w2_lora_a_stacked[0], ctx.w2_lora_b_stacked[0],
                ctx.local_num_experts, top_k, configs, mxfp4=mxfp4,
                slot_ranks=live.tracking())
    _warmed.add(key)
    _done_contexts[ctx] = True
    if a13[0].is_cuda:
        torch.cuda.empty_cache()
    vllm_logger().info("MoE-LoRA kernels compiled for %d batch-size buckets (%s)", len(configs),
                       ", ".join(str(m) for m, _ in configs))


@contextlib.contextmanager
def compiling_on_purpose():
    """A warm-up's compiles: not reported by the watcher; afterwards any compile is."""
    global _warming
    _warming = True
    try:
        yield
    finally:
        _warming = False
        _done.append(True)


def watch_compiles() -> None:
    """Chains the pre- and post-compile hooks once per process (Triton's ``knobs``; absent:
    no-op). The pre-compile hook must return a falsy value (a true one skips the compile): it
    returns what the previous hook returns."""
    global _watching
    if _watching:
        return
    try:
        from triton import knobs
    except ImportError:  # older Triton: no hook to chain
        return
    previous_pre = getattr(knobs.runtime, "jit_cache_hook", None)
    previous = knobs.runtime.jit_post_compile_hook
    started: dict[tuple[str, str], float] = {}

    def before_compile(**kwargs):
        started[(getattr(kwargs.get("fn"), "name", ""), str(kwargs.get("key")))] = \
            time.perf_counter()
        return previous_pre(**kwargs) if previous_pre is not None else None

    def on_compile(**kwargs):
        name = getattr(kwargs.get("fn"), "name", "")
        t0 = started.pop((name, str(kwargs.get("key"))), None)
        ms = (time.perf_counter() - t0) * 1e3 if t0 is not None else float("nan")
        if (_warmed or _done) and not _warming:
            if name.rsplit(".", 1)[-1] in OUR_KERNELS:
                COMPILES_DURING_SERVING.append(name)
                vllm_logger().warning("MoE-LoRA kernel %s compiled after the warm-up in %.0f ms "
                                      "(key %s): the engine stalls while it compiles", name, ms,
                                      kwargs.get("key"))
            else:
                OTHER_COMPILES.append((name, ms / 1e3, str(kwargs.get("key"))))
                # the key (its specialization and constants) says which variant the warm-up missed
                vllm_logger().info("Triton kernel %s compiled after the warm-up in %.0f ms (key %.600s)",
                                   name, ms, kwargs.get("key"))
        return previous(**kwargs) if previous is not None else None

    if hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = before_compile
    knobs.runtime.jit_post_compile_hook = on_compile
    _watching = True
