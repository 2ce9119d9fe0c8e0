"""vLLM 0.24: the per-step LoRA index conversion (``convert_mapping``) without a Python loop.

Every step with an adapter, ``PunicaWrapperBase._update_base_metadata`` turns the step's
per-token adapter ids (``LoRAMapping.index_mapping``, one Python int per token) into slot
indices with ``lora_index_to_id.index(id)`` per token, in a Python loop, before the forward
is launched: for a 1600-token prefill step about a millisecond of host time with the GPU idle.
``convert_mapping`` here returns the same tensors (same dtypes, shapes, values, device,
asynchronous host-to-device copies): from NumPy for large steps (the distinct ids looked up
once each), with one dict lookup per token for small ones (decode), where NumPy's fixed cost
would be more than the loop.

An id that is not in ``lora_index_to_id`` raises ``ValueError``, as ``list.index`` does there.
``install`` replaces the name ``punica_base`` calls; the caller checks the vLLM version.
"""

from __future__ import annotations

import numpy as np
import torch

_originals: dict[str, object] = {}


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


def convert_mapping(mapping, lora_index_to_id: list[int | None], max_loras: int,
                    vocab_size: int, extra_vocab_size: int, device: torch.device):
    """vLLM 0.24's ``convert_mapping`` (same arguments and results): ``(base_indices [N],
    sampler_indices [R], sampler_indices_padded [R], embeddings_indices [2, N], indices_len)``
    for N tokens and R requests."""
    from vllm.utils.torch_utils import async_tensor_h2d

    slot_of = _slot_of(lora_index_to_id)
    ids = mapping.index_mapping
    if len(ids) >= NUMPY_FROM:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        lora = slot_indices(ids, slot_of)
        rows = np.stack([ids, lora, np.where(ids > 0, lora, 0)])
    else:
        ids = list(ids)
        lora = slot_indices(ids, slot_of)
        rows = [ids, lora, [s if x > 0 else 0 for x, s in zip(ids, lora)]]
    indices = async_tensor_h2d(rows, dtype=torch.long, device=device)
    sampler_indices = async_tensor_h2d(slot_indices(list(mapping.prompt_mapping), slot_of),
                                       dtype=torch.long, device=device)
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


def install() -> None:
    """Replaces ``convert_mapping`` where ``punica_base`` calls it (idempotent)."""
    from vllm.lora.punica_wrapper import punica_base

    if not _originals:
        _originals["convert_mapping"] = punica_base.convert_mapping
        punica_base.convert_mapping = convert_mapping


def uninstall() -> None:
    """Restores vLLM's function (tests)."""
    from vllm.lora.punica_wrapper import punica_base

    if _originals:
        punica_base.convert_mapping = _originals.pop("convert_mapping")
