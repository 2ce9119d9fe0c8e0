"""vLLM 0.24: the per-step LoRA mapping on the host — index conversion (``convert_mapping``)
without a Python loop, kernel metadata without waiting for the GPU.

Every step with an adapter, ``PunicaWrapperBase._update_base_metadata`` turns the step's
per-token adapter ids (``LoRAMapping.index_mapping``, one Python int per token) into slot
indices with ``lora_index_to_id.index(id)`` per token, in a Python loop, before the forward
is launched: for a 1600-token prefill step about a millisecond of host time with the GPU idle.
``convert_mapping`` here returns the same tensors (same dtypes, shapes, values, device,
asynchronous host-to-device copies): from NumPy for large steps (the distinct ids looked up
once each), with one dict lookup per token for small ones (decode), where NumPy's fixed cost
would be more than the loop.

An id that is not in ``lora_index_to_id`` raises ``ValueError``, as ``list.index`` does there.

The same step then builds the LoRA kernels' metadata (``LoRAKernelMeta.prepare_tensors``, for
the tokens and for the requests) from the device copy of those slots: ``torch.all(mapping ==
-1)`` written into a CPU flag, ``if`` on it, and ``torch.unique`` on the GPU — three waits for
the GPU per call, two calls per step, before the step's forward is launched, so the host cannot
prepare a step while the GPU runs the previous one. ``prepare_kernel_meta`` computes the same
tensors and flags from the host's slots (NumPy) and sends them with asynchronous copies from
pinned memory: no wait. ``update_metadata`` is vLLM's ``PunicaWrapperGPU.update_metadata`` built
on both; loraplex's punica wrapper (``kernels.vllm.cuda.punica``) runs it.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

_last: dict[str, tuple] = {}  # the last step's host slots (``host_slots``), by mapping object


NUMPY_FROM = 256  # tokens from which NumPy beats a dict lookup per token (decode steps: not)


def _slot_of(lora_index_to_id: list[int | None]) -> dict[int, int]:
    """Adapter id → its first slot (what ``list.index`` finds)."""
    out: dict[int, int] = {}
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is not None and lora_id not in out:
            out[lora_id] = slot
    return out


def slot_indices(ids, slot_of: dict[int, int]):
    """Slot of each adapter id in ``ids`` (ids <= 0 mean no adapter → -1): a list for a
    sequence of ints, an int64 array for an array. Unknown ids raise ``ValueError``."""
    try:
        if isinstance(ids, np.ndarray):
            if ids.size == 0:
                return ids.copy()
            distinct, where = np.unique(ids, return_inverse=True)
            slots = np.array([slot_of[i] if i > 0 else -1 for i in distinct.tolist()],
                             dtype=np.int64)
            return slots[where.reshape(-1)]
        return [slot_of[i] if i > 0 else -1 for i in ids]
    except KeyError as e:
        raise ValueError(f"adapter id {e.args[0]} is in no LoRA slot") from None


def host_slots(mapping, lora_index_to_id: list[int | None]):
    """``(adapter ids, slot per token, slot per request)`` of a step's ``LoRAMapping`` (-1: no
    adapter): NumPy arrays from ``NUMPY_FROM`` tokens, lists below. The last step's result is
    kept, so ``convert_mapping`` and ``update_metadata`` of one step compute it once."""
    key = tuple(lora_index_to_id)
    last = _last.get("step")
    if last is not None and last[0] is mapping and last[1] == key:
        return last[2]
    slot_of = _slot_of(lora_index_to_id)
    ids = mapping.index_mapping
    ids = np.asarray(ids, dtype=np.int64).reshape(-1) if len(ids) >= NUMPY_FROM else list(ids)
    slots = (ids, slot_indices(ids, slot_of), slot_indices(list(mapping.prompt_mapping), slot_of))
    _last["step"] = (mapping, key, slots)
    return slots


def convert_mapping(mapping, lora_index_to_id: list[int | None], max_loras: int,
                    vocab_size: int, extra_vocab_size: int, device: torch.device):
    """vLLM 0.24's ``convert_mapping`` (same arguments and results): ``(base_indices [N],
    sampler_indices [R], sampler_indices_padded [R], embeddings_indices [2, N], indices_len)``
    for N tokens and R requests."""
    from vllm.utils.torch_utils import async_tensor_h2d

    ids, lora, prompts = host_slots(mapping, lora_index_to_id)
    if isinstance(ids, np.ndarray):
        rows = np.stack([ids, lora, np.where(ids > 0, lora, 0)])
    else:
        rows = [ids, lora, [s if x > 0 else 0 for x, s in zip(ids, lora)]]
    indices = async_tensor_h2d(rows, dtype=torch.long, device=device)
    sampler_indices = async_tensor_h2d(prompts, dtype=torch.long, device=device)
    embeddings_indices = torch.stack([indices[2] * extra_vocab_size,
                                      indices[2] * (vocab_size + extra_vocab_size)])
    embeddings_indices = torch.where(embeddings_indices == -1, max_loras - 1,
                                     embeddings_indices)
    base_indices = indices[1]
    padded = torch.where(sampler_indices == -1, max_loras - 1, sampler_indices)
    n = len(padded)
    padded = torch.arange(0, n, device=device, dtype=torch.long) + padded * n
    indices_len = [base_indices.shape[-1], sampler_indices.shape[-1], padded.shape[-1],
                   embeddings_indices.shape[-1]]
    return base_indices, sampler_indices, padded, embeddings_indices, indices_len


def prepare_kernel_meta(meta, slots) -> None:
    """vLLM 0.24's ``LoRAKernelMeta.prepare_tensors`` for ``slots`` (slot per token or request,
    -1: none; list or int array: the host's copy of what the device holds): the same device
    tensors (``token_lora_mapping``, ``token_indices_sorted_by_lora_ids`` — a stable sort —,
    ``active_lora_ids`` and ``num_tokens_per_lora`` of the sorted distinct slots,
    ``lora_token_start_loc``) and CPU flags (``no_lora_flag_cpu``, ``num_active_loras_cpu``
    rounded up to a captured count), sent by asynchronous copies: nothing waits for the GPU."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    meta._reset()
    no_lora = bool((slots == -1).all())
    meta.no_lora_flag_cpu[0] = no_lora
    if no_lora:
        return
    distinct, counts = np.unique(slots, return_counts=True)
    num_active = distinct.shape[0]
    if meta.captured_lora_counts:
        at = bisect.bisect_left(meta.captured_lora_counts, num_active)
        if at < len(meta.captured_lora_counts):
            num_active = meta.captured_lora_counts[at]
    meta.num_active_loras_cpu[0] = num_active
    order = np.argsort(slots, kind="stable")
    parts = (slots, order, distinct, counts, np.cumsum(counts))
    staged = torch.from_numpy(np.concatenate(parts).astype(np.int32))
    dev = meta.token_lora_mapping.device
    if dev.type == "cuda":
        staged = staged.pin_memory()
    n, k = slots.shape[0], distinct.shape[0]
    starts = np.cumsum([0] + [p.shape[0] for p in parts]).tolist()
    targets = (meta.token_lora_mapping[:n], meta.token_indices_sorted_by_lora_ids[:n],
               meta.active_lora_ids[:k], meta.num_tokens_per_lora[:k],
               meta.lora_token_start_loc[1:1 + k])
    for target, lo, hi in zip(targets, starts, starts[1:]):
        target.copy_(staged[lo:hi], non_blocking=True)


def base_metadata(wrapper, mapping, lora_index_to_id, max_loras: int, vocab_size: int) -> None:
    """vLLM 0.24's ``PunicaWrapperBase._update_base_metadata`` with ``convert_mapping`` above:
    the wrapper's token, sampler and embedding indices of the step."""
    base, sampler, padded, embeddings, indices_len = convert_mapping(
        mapping, lora_index_to_id, max_loras, vocab_size, 0, wrapper.device)
    wrapper._token_lora_indices[: base.shape[0]].copy_(base)
    wrapper._sampler_indices[: sampler.shape[0]].copy_(sampler)
    wrapper._sampler_indices_padded[: padded.shape[0]].copy_(padded)
    wrapper._embeddings_indices[: embeddings.shape[0], : embeddings.shape[1]].copy_(embeddings)
    wrapper.indices_len[:] = indices_len


def update_metadata(wrapper, mapping, lora_index_to_id, max_loras, vocab_size) -> None:
    """vLLM 0.24's ``PunicaWrapperGPU.update_metadata`` with the base indices from
    ``base_metadata`` and the kernel metadata prepared from the host's slots
    (``prepare_kernel_meta``) instead of from the device."""
    wrapper.is_prefill = mapping.is_prefill
    base_metadata(wrapper, mapping, lora_index_to_id, max_loras, vocab_size)
    _, tokens, prompts = host_slots(mapping, lora_index_to_id)
    prepare_kernel_meta(wrapper.token_mapping_meta, tokens)
    prepare_kernel_meta(wrapper.prompt_mapping_meta, prompts)


def reset() -> None:
    """Forgets the last step's slots."""
    _last.clear()
