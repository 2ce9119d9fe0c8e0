"""What an MoE layer with multi-LoRA is, as data shared by the oracle and the kernels: the two
activations (SiLU-and-mul; GPT-OSS's clamped swiglu with its constants) and the stacked LoRA
weights of one layer. Layouts and notation: ``kernels.reference``'s module doc."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


@dataclass
class MoELoRAWeights:
    """Stacked LoRA weights of one MoE layer for L adapter slots (layouts in the module doc).

    ``has_experts [L]`` (bool) marks slots whose adapter carries expert LoRA; slots without it hold
    zeros and may be skipped by kernels (an adapter with only attention LoRA is such a slot).
    """

    w13_a: torch.Tensor  # [L, E, r, H]
    w13_b: torch.Tensor  # [L, E, 2I, r]
    w2_a: torch.Tensor  # [L, E, r, I]
    w2_b: torch.Tensor  # [L, E, H, r]
    scaling: torch.Tensor  # [L]
    has_experts: torch.Tensor  # [L] bool

    @property
    def num_slots(self) -> int:
        return self.w13_a.shape[0]

    @property
    def rank(self) -> int:
        return self.w13_a.shape[2]

    @staticmethod
    def from_gate_up(
        gate_a: torch.Tensor, gate_b: torch.Tensor, up_a: torch.Tensor, up_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly folds separate gate/up LoRA pairs into one shared-A pair of rank 2r.

        ``gate_a, up_a [..., r, H]``, ``gate_b, up_b [..., I, r]`` → ``w13_a [..., 2r, H]`` and a
        block-diagonal ``w13_b [..., 2I, 2r]`` (gate rows first, the ``silu`` row order):
        ``x A^T B^T`` then equals ``[x gate_a^T gate_b^T, x up_a^T up_b^T]``.
        """
        r = gate_a.shape[-2]
        i = gate_b.shape[-2]
        w13_a = torch.cat([gate_a, up_a], dim=-2)
        w13_b = gate_b.new_zeros(*gate_b.shape[:-2], 2 * i, 2 * r)
        w13_b[..., :i, :r] = gate_b
        w13_b[..., i:, r:] = up_b
        return w13_a, w13_b


def apply_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``gate_up [..., 2I]`` → ``[..., I]`` for ``silu`` (SiLU-and-mul) or ``swigluoai`` (GPT-OSS)."""
    if activation == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    raise ValueError(f"unknown activation {activation!r}; expected 'silu' or 'swigluoai'")
