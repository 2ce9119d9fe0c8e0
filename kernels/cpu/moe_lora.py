"""CPU implementation of the MoE layer with multi-LoRA, batched by (expert, adapter).

Same math as ``kernels.reference.moe_lora_reference`` (see its module doc for notation and
layouts), computed in phases instead of token by token:

1. every (token, top-k slot) pair is keyed by (expert e, adapter slot a) and sorted;
2. per expert, one GEMM ``x_e W13_e^T`` over all of its pairs (into one ``[P, 2I]`` buffer);
3. the gate_up LoRA ``s_a (x A^T) B^T`` is added: one pair of thin GEMMs per (expert, adapter)
   group when groups are large (prefill), or gathered per-pair A/B and two batched matmuls when
   they are small (decode), see ``GROUPED_MIN_ROWS``;
4. the activation over all pairs at once, then steps 2-3 again for the down projection;
5. the routing-weighted results are summed per token with one ``index_add_``.

The LoRA weights may come in *slices* (``MoELoRASlices``): vLLM keeps gate and up LoRA as two
slices with separate A matrices (``w13`` output = slices concatenated for ``silu``, interleaved
even/odd for ``swigluoai``), while the reference and PEFT's fused 3-D layout use one slice with a
shared A. Tensors with expert dimension 1 are shared by all experts (vLLM's shared MoE LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe_math import MoELoRAWeights, apply_activation

ACTIVATIONS = ("silu", "swigluoai")
# Below this many rows per (expert, adapter) group on average, LoRA runs as gathered batched
# matmuls instead of one pair of GEMMs per group (Python overhead dominates tiny GEMMs).
GROUPED_MIN_ROWS = 8
# ... and only while the gathered A/B copies stay small (elements: rows x rank x (in + out)).
GATHER_MAX_ELEMENTS = 1 << 20


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


def _column_blocks(num_slices: int, width: int, activation: str) -> list[slice]:
    """Columns of the layer output that LoRA slice j writes: all (1 slice), the j-th block
    (``silu``: ``[gate | up]``) or every other column from j (``swigluoai``: interleaved)."""
    if num_slices == 1:
        return [slice(None)]
    if activation == "swigluoai":
        return [slice(j, None, num_slices) for j in range(num_slices)]
    size = width // num_slices
    return [slice(j * size, (j + 1) * size) for j in range(num_slices)]


def _add_lora(
    out: torch.Tensor,
    inp: torch.Tensor,
    a_slices: tuple[torch.Tensor, ...],
    b_slices: tuple[torch.Tensor, ...],
    scaling: torch.Tensor | None,
    pair_lora: torch.Tensor,
    pair_expert: torch.Tensor,
    groups: list[tuple[int, int, int, int]],
    activation: str,
) -> None:
    """``out[p] += s_a · (inp[p] A_{a,e}^T) B_{a,e}^T`` for every sorted pair p with an adapter.

    Large (expert, adapter) groups run as two thin GEMMs each; when groups are small on average
    (decode) and the weights thin, the pairs' A and B are gathered and multiplied in two batched
    matmuls instead.
    """
    cols = _column_blocks(len(a_slices), out.shape[1], activation)
    rows_total = sum(t - s for _, _, s, t in groups)
    gathered_elements = rows_total * a_slices[0].shape[2] * (inp.shape[1] + out.shape[1])
    if rows_total >= GROUPED_MIN_ROWS * len(groups) or gathered_elements > GATHER_MAX_ELEMENTS:
        for e, a, s, t in groups:
            scale = scaling[a].to(out.dtype) if scaling is not None else None
            for wa, wb, c in zip(a_slices, b_slices, cols):
                delta = (inp[s:t] @ _expert_view(wa, a, e).t()) @ _expert_view(wb, a, e).t()
                out[s:t, c] += delta * scale if scale is not None else delta
        return
    rows = torch.cat([torch.arange(s, t) for _, _, s, t in groups])
    lora_idx, expert_idx = pair_lora[rows], pair_expert[rows]
    x_rows = inp[rows].unsqueeze(-1)  # [n, in, 1]
    block = out[rows]
    for wa, wb, c in zip(a_slices, b_slices, cols):
        a_sel = wa[lora_idx, expert_idx if wa.shape[1] != 1 else 0]  # [n, r, in]
        b_sel = wb[lora_idx, expert_idx if wb.shape[1] != 1 else 0]  # [n, out_j, r]
        delta = torch.bmm(b_sel, torch.bmm(a_sel, x_rows)).squeeze(-1)
        if scaling is not None:
            delta = delta * scaling[lora_idx].to(delta.dtype).unsqueeze(-1)
        block[:, c] += delta
    out[rows] = block


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
    order, pair_lora, groups = pair_groups(topk_ids, token_lora, enabled)
    P = order.numel()
    tokens = order // K
    pair_expert = topk_ids.reshape(-1)[order].long()
    experts = [(e, s, t) for e, s, t, _ in _by_expert(groups)]
    lora_groups = [g for g in groups if g[1] >= 0]
    xs = x[tokens]  # [P, H], pairs sorted by (expert, adapter)

    gate_up = x.new_empty(P, w13.shape[1])
    for e, s, t in experts:
        torch.matmul(xs[s:t], w13[e].t(), out=gate_up[s:t])
    if w13_bias is not None:
        gate_up += w13_bias[pair_expert]
    if lora_groups:
        _add_lora(gate_up, xs, lora.w13_a, lora.w13_b, lora.scaling, pair_lora, pair_expert,
                  lora_groups, activation)
    h = apply_activation(gate_up, activation)

    down = x.new_empty(P, w2.shape[1])
    for e, s, t in experts:
        torch.matmul(h[s:t], w2[e].t(), out=down[s:t])
    if w2_bias is not None:
        down += w2_bias[pair_expert]
    if lora_groups:
        _add_lora(down, h, (lora.w2_a,), (lora.w2_b,), lora.scaling, pair_lora, pair_expert,
                  lora_groups, activation)

    down = down.to(torch.float32)
    if apply_router_weight:
        down *= topk_weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
    y.index_add_(0, tokens, down)
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
