"""The batch's tokens grouped by adapter slot, as the dense LoRA kernels read them
(``kernels.dense_lora.launch``): vLLM's per-step punica metadata (``LoRAKernelMeta``), or built
here from a per-token slot vector (tests, benchmarks, warm-up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenGroups:
    """Tokens grouped by adapter slot (vLLM's ``LoRAKernelMeta`` buffers, or ``group_tokens``).

    ``sorted_idx [>=M]`` int32 token ids grouped by slot; ``slot``, ``ntok``, ``start``
    ``[G]`` int32 per group (slot -1: no adapter; unused groups have ntok 0).
    """

    sorted_idx: torch.Tensor
    slot: torch.Tensor
    ntok: torch.Tensor
    start: torch.Tensor
    num_tokens: int

    @property
    def num_groups(self) -> int:
        return self.slot.shape[0]


def group_tokens(token_lora: torch.Tensor, num_groups: int) -> TokenGroups:
    """``TokenGroups`` of ``token_lora [M]`` (slot or -1) with ``num_groups`` (>= distinct
    values) entries, as vLLM prepares them (tests and benchmarks; syncs the device)."""
    m = token_lora.shape[0]
    dev = token_lora.device
    order = torch.sort(token_lora, stable=True).indices.to(torch.int32)
    ids, counts = torch.unique(token_lora, sorted=True, return_counts=True)
    slot = torch.full((num_groups,), -1, dtype=torch.int32, device=dev)
    ntok = torch.zeros(num_groups, dtype=torch.int32, device=dev)
    start = torch.zeros(num_groups + 1, dtype=torch.int32, device=dev)
    slot[: ids.numel()] = ids.to(torch.int32)
    ntok[: ids.numel()] = counts.to(torch.int32)
    start[1: ids.numel() + 1] = torch.cumsum(counts, 0).to(torch.int32)
    return TokenGroups(order, slot, ntok, start, m)
