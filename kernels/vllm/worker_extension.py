"""Methods loraplex adds to vLLM's workers (engine argument ``worker_extension_cls`` =
``WORKER_EXTENSION``), reached from the frontend through ``AsyncLLM.collective_rpc``.

``loraplex_warm_lora_steps``: one forward per token count with LoRA active in every slot
(vLLM's own dummy adapters, as its CUDA-graph capture uses them), so the kernels of the LoRA
path — loraplex's, and triton_kernels' MXFP4 GEMM and routing variants that the expert-LoRA
path launches instead of the fused base path — compile before the replica takes traffic, not in
the first mixed step of each token-count class with an adapter (every stream of the batch stalls
for the compile). Touches ``GPUModelRunner._dummy_run`` (``num_active_loras``, ``remove_lora``),
its ``input_ids`` buffer and the worker's LoRA manager, as the releases of
``kernels.vllm.versions`` have them.

``loraplex_compiles``: the Triton compiles this worker's process saw after the warm-up
(``kernels.vllm.cuda.warmup``: loraplex's kernels, and every other with its specialisation key).

``loraplex_prepare_lora`` / ``loraplex_lora_ready`` / ``loraplex_discard_lora``: an adapter's load
prepared off the engine's loop before ``add_lora`` (``kernels.vllm.lora_loads``).

The dummy forwards read whatever the input buffer holds (zeros at start): identical tokens send
every token to the same experts, and the MoE kernels' launch heuristics, which size blocks from
per-expert token counts, then compile the variants of that skew, not those of served batches.
The buffer is filled with random ids first, so the dummy steps route like traffic.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels.vllm.versions import require_any

WORKER_EXTENSION = "kernels.vllm.worker_extension.LoraplexWorkerExtension"
WARM_LORA_STEPS = "loraplex_warm_lora_steps"
PREPARE_LORA = "loraplex_prepare_lora"
LORA_READY = "loraplex_lora_ready"
DISCARD_LORA = "loraplex_discard_lora"
COMPILES = "loraplex_compiles"
RESERVE_PINNED = "loraplex_reserve_pinned"
logger = logging.getLogger("vllm.loraplex")


class LoraplexWorkerExtension:
    """Mixed into vLLM's worker class (``self.model_runner`` is the worker's model runner)."""

    def loraplex_warm_lora_steps(self, counts: list[int], num_active_loras: int) -> list[float]:
        """One dummy forward of each of ``counts`` tokens with ``num_active_loras`` dummy
        adapters active; returns each forward's seconds. Refuses (``RuntimeError``) when a served
        adapter is registered: the dummy adapters take slot ids 1.. and are removed after."""
        require_any("loraplex's LoRA shape warm-up")
        runner = self.model_runner
        manager = getattr(runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA shape warm-up: this engine has no LoRA (enable_lora is off)")
        if manager.list_adapters():
            raise RuntimeError("LoRA shape warm-up: adapters are registered already; it runs before any is")
        seconds = []
        randomize_input_ids(runner)
        try:
            for n in counts:
                t0 = time.perf_counter()
                runner._dummy_run(n, remove_lora=False, num_active_loras=num_active_loras)
                seconds.append(time.perf_counter() - t0)
        finally:
            manager.remove_all_adapters()
        return seconds

    def loraplex_compiles(self) -> dict[str, list]:
        """``{"ours": [kernel, ...], "other": [[kernel, seconds, key], ...]}``, in compile order,
        since this process's warm-up (empty where the watcher is not installed: CPU)."""
        from kernels.vllm.cuda import warmup

        return {"ours": list(warmup.COMPILES_DURING_SERVING),
                "other": [list(c) for c in warmup.OTHER_COMPILES]}

    def loraplex_prepare_lora(self, lora_request, threads: int, pinning: str) -> bool:
        """Starts preparing an adapter off the engine's loop (``kernels.vllm.lora_loads``), pinned
        before ``add_lora`` or after (``pinning``: ``kernels.vllm.lora_pinning``); ``lora_request``
        arrives as vLLM's RPC encodes a ``LoRARequest`` (a list: array-like)."""
        import msgspec
        from vllm.lora.request import LoRARequest

        from kernels.vllm import lora_loads

        if not isinstance(lora_request, LoRARequest):
            lora_request = msgspec.convert(lora_request, LoRARequest)
        return lora_loads.prepare(self.model_runner.lora_manager, lora_request, threads, pinning)

    def loraplex_reserve_pinned(self, nbytes: int) -> list[float]:
        """Reserves the page-locked region adapters prepared with ``pooled`` pinning are copied
        into (``kernels.vllm.pinned_region``; none on a host that cannot page-lock);
        ``[its bytes, seconds spent]``."""
        from kernels.vllm import lora_pinning, pinned_region

        size, seconds = pinned_region.reserve(int(nbytes), lora_pinning.pin_available())
        return [float(size), seconds]

    def loraplex_lora_ready(self, lora_int_id: int) -> bool:
        from kernels.vllm import lora_loads

        return lora_loads.ready(lora_int_id)

    def loraplex_discard_lora(self, lora_int_id: int) -> bool:
        from kernels.vllm import lora_loads

        return lora_loads.discard(lora_int_id)


def randomize_input_ids(runner) -> None:
    """Random ids over the model's vocabulary in ``runner.input_ids`` (a ``CpuGpuBuffer``'s
    ``gpu`` tensor, or a tensor); the next real step overwrites them."""
    buf = runner.input_ids
    ids = getattr(buf, "gpu", buf)
    if not isinstance(ids, torch.Tensor):
        raise RuntimeError(f"LoRA shape warm-up: the model runner's input_ids is a {type(buf).__name__}")
    ids.random_(0, runner.model_config.get_vocab_size())
