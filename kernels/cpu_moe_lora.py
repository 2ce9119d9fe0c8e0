"""CPU implementation of the MoE layer with multi-LoRA, batched by (expert, adapter).

Same math as ``kernels.reference.moe_lora_reference`` (see its module doc for notation and
layouts), computed group by group instead of token by token:

1. every (token, top-k slot) pair is keyed by (expert e, adapter slot a) and sorted;
2. per expert: one GEMM ``x_e W13_e^T`` for all of its pairs, then per adapter sub-group the two
   thin LoRA GEMMs ``(x A^T) B^T`` added in place, the activation, the down GEMM and its LoRA;
3. the routing-weighted results are scattered back with ``index_add_``.

The LoRA weights may come in *slices* (``MoELoRASlices``): vLLM keeps gate and up LoRA as two
slices with separate A matrices (``w13`` output = slices concatenated for ``silu``, interleaved
even/odd for ``swigluoai``), while the reference and PEFT's fused 3-D layout use one slice with a
shared A. Tensors with expert dimension 1 are shared by all experts (vLLM's shared MoE LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import MoELoRAWeights, apply_activation

ACTIVATIONS = ("silu", "swigluoai")


@dataclass
class MoELoRASlices:
    """Stacked LoRA weights of one MoE layer, gate/up possibly split in slices.

    - ``w13_a``: tuple of S tensors ``[L, E or 1, r, H]``; ``w13_b``: tuple of S ``[L, E, 2I/S, r]``.
    - ``w2_a [L, E, r, I]``, ``w2_b [L, E or 1, H, r]``.
    - ``scaling [L]`` float or None (None: already folded into the B matrices, as vLLM does).
    - ``enabled [L]`` bool: slots whose adapter has expert LoRA in this layer; others are skipped.
    """

    w13_a: tuple[torch.Tensor, ...]
    w13_b: tuple[torch.Tensor, ...]
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    scaling: torch.Tensor | None
    enabled: torch.Tensor

    @staticmethod
    def from_weights(lora: MoELoRAWeights) -> "MoELoRASlices":
        """One-slice view of the reference layout (shared A, B rows in ``w13`` row order)."""
        return MoELoRASlices(
            w13_a=(lora.w13_a,),
            w13_b=(lora.w13_b,),
            w2_a=lora.w2_a,
            w2_b=lora.w2_b,
            scaling=lora.scaling,
            enabled=lora.has_experts,
        )


def _expert_view(t: torch.Tensor, a: int, e: int) -> torch.Tensor:
    """``t[a, e]``, or ``t[a, 0]`` when the expert dimension is shared (size 1)."""
    return t[a, e if t.shape[1] != 1 else 0]


def _w13_lora_delta(
    xs: torch.Tensor, lora: MoELoRASlices, a: int, e: int, activation: str
) -> torch.Tensor:
    """``xs [n, H]`` → gate_up LoRA delta ``[n, 2I]`` in ``w13`` row order (unscaled)."""
    parts = [
        (xs @ _expert_view(wa, a, e).t()) @ _expert_view(wb, a, e).t()
        for wa, wb in zip(lora.w13_a, lora.w13_b)
    ]
    if len(parts) == 1:
        return parts[0]
    if activation == "swigluoai":
        return torch.stack(parts, dim=-1).flatten(-2)
    return torch.cat(parts, dim=-1)


def pair_groups(
    topk_ids: torch.Tensor, token_lora: torch.Tensor, enabled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]:
    """Sorts the T·K (token, slot) pairs by (expert, adapter).

    Returns ``order [P]`` (indices into the flattened ``[T·K]`` pairs), ``pair_lora [P]`` (the
    adapter slot of each sorted pair, -1 for none or a slot without expert LoRA) and the groups
    ``(expert, adapter, start, end)`` over the sorted order. Pairs with a negative expert id
    (dropped by expert parallelism) are left out.
    """
    T, K = topk_ids.shape
    experts = topk_ids.reshape(-1).long()
    lora = token_lora.long().repeat_interleave(K)
    lora_ok = (lora >= 0) & enabled.to(device=lora.device, dtype=torch.bool)[lora.clamp_min(0)]
    lora = torch.where(lora_ok, lora, torch.full_like(lora, -1))
    num_slots = int(enabled.shape[0])
    key = experts * (num_slots + 1) + (lora + 1)
    valid = experts >= 0
    order = torch.argsort(torch.where(valid, key, torch.full_like(key, -1)), stable=True)
    order = order[int((~valid).sum()) :]
    keys, counts = torch.unique_consecutive(key[order], return_counts=True)
    groups = []
    start = 0
    for k, c in zip(keys.tolist(), counts.tolist()):
        groups.append((k // (num_slots + 1), k % (num_slots + 1) - 1, start, start + c))
        start += c
    return order, lora[order], groups


def moe_lora_cpu_sliced(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_lora: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: MoELoRASlices | None,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    apply_router_weight: bool = True,
) -> torch.Tensor:
    """The MoE layer with per-token adapters, grouped by (expert, adapter); ``y [T, H]`` in x.dtype.

    Args: as ``moe_lora_reference`` (``token_lora [T]`` slot or -1; ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``), with ``lora`` in the sliced layout. ``apply_router_weight=False`` sums the
    experts' outputs unweighted (the weights were already applied to the input).
    Matmuls run in ``x.dtype``; the output is accumulated in float32.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    T, H = x.shape
    K = topk_ids.shape[1]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return y.to(x.dtype)
    if lora is None:
        token_lora = torch.full_like(token_lora, -1)
        enabled = torch.zeros(1, dtype=torch.bool)
    else:
        enabled = lora.enabled
    order, _pair_lora, groups = pair_groups(topk_ids, token_lora, enabled)
    tokens = order // K
    weights = topk_weights.reshape(-1)[order].to(torch.float32)
    for e, start, end, sub in _by_expert(groups):
        t_idx = tokens[start:end]
        xs = x[t_idx]
        gu = xs @ w13[e].t()
        if w13_bias is not None:
            gu = gu + w13_bias[e]
        lora_rows = [(a, s - start, t - start) for a, s, t in sub if a >= 0]
        for a, s, t in lora_rows:
            delta = _w13_lora_delta(xs[s:t], lora, a, e, activation)
            if lora.scaling is not None:
                delta = delta * lora.scaling[a].to(delta.dtype)
            gu[s:t] += delta.to(gu.dtype)
        h = apply_activation(gu, activation)
        d = h @ w2[e].t()
        if w2_bias is not None:
            d = d + w2_bias[e]
        for a, s, t in lora_rows:
            delta = (h[s:t] @ lora.w2_a[a, e].t()) @ _expert_view(lora.w2_b, a, e).t()
            if lora.scaling is not None:
                delta = delta * lora.scaling[a].to(delta.dtype)
            d[s:t] += delta.to(d.dtype)
        d = d.to(torch.float32)
        if apply_router_weight:
            d = d * weights[start:end, None]
        y.index_add_(0, t_idx, d)
    return y.to(x.dtype)


def _by_expert(groups):
    """Yields ``(expert, start, end, [(adapter, start, end), ...])`` from sorted groups."""
    i = 0
    while i < len(groups):
        e = groups[i][0]
        j = i
        while j < len(groups) and groups[j][0] == e:
            j += 1
        sub = [(a, s, t) for _e, a, s, t in groups[i:j]]
        yield e, sub[0][1], sub[-1][2], sub
        i = j


def moe_lora_cpu(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_lora: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: MoELoRAWeights | None,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``moe_lora_reference`` (same arguments and layouts), grouped for speed."""
    return moe_lora_cpu_sliced(
        x,
        topk_ids,
        topk_weights,
        token_lora,
        w13,
        w2,
        MoELoRASlices.from_weights(lora) if lora is not None else None,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )
