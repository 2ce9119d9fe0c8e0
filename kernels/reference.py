"""PyTorch reference of a Mixture-of-Experts layer with multi-LoRA: the correctness oracle.

Every kernel in ``kernels/`` (the CPU path and the Triton ops) is checked against this module;
only tests and benchmarks import it (the definitions production shares are in ``kernels.moe_math``).
It is written for clarity, not speed: one loop over (token, expert slot), float math in the
input dtype unless ``compute_dtype`` says otherwise.

Notation
--------
T tokens, H hidden size, I expert intermediate size, E experts, K experts per token (top-k),
L adapter slots, r LoRA rank (the largest rank; smaller adapters are zero-padded).

For each token t with adapter a = token_lora[t] (``-1``: no adapter) and each of its K experts e
with routing weight w::

    gate_up = x W13_e^T (+ b13_e) + s_a * (x A13_{a,e}^T) B13_{a,e}^T      # [2I]
    h       = act(gate_up)                                                 # [I]
    down    = h W2_e^T  (+ b2_e)  + s_a * (h A2_{a,e}^T)  B2_{a,e}^T        # [H]
    y[t]   += w * down

Weight layouts (the same as vLLM's fused MoE and MoE-LoRA stacks)
-----------------------------------------------------------------
- ``w13``: ``[E, 2I, H]``; for ``activation="silu"`` rows ``[0, I)`` are gate and ``[I, 2I)`` up;
  for ``activation="swigluoai"`` (GPT-OSS) gate and up are interleaved: even rows gate, odd up.
- ``w2``: ``[E, H, I]``.
- ``w13_bias``: ``[E, 2I]`` or None; ``w2_bias``: ``[E, H]`` or None.
- LoRA (``MoELoRAWeights``): ``w13_a [L, E, r, H]`` is shared by gate and up (PEFT's fused 3-D
  layout shares it; per-expert 2-D adapters with separate gate/up A matrices are stacked rank-wise
  with a block-diagonal B, see ``MoELoRAWeights.from_gate_up``), ``w13_b [L, E, 2I, r]`` in the
  same row order as ``w13``, ``w2_a [L, E, r, I]``, ``w2_b [L, E, H, r]``, ``scaling [L]``.
"""

from __future__ import annotations

import torch

from kernels.moe_math import MoELoRAWeights, apply_activation


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | float
) -> torch.Tensor:
    """``x [N, in]``, ``a [r, in]``, ``b [out, r]`` → ``scale * (x a^T) b^T`` of shape ``[N, out]``."""
    return scale * ((x @ a.t()) @ b.t())


def moe_lora_reference(
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
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The MoE layer with per-token LoRA adapters; returns ``y [T, H]`` in ``x.dtype``.

    Args:
        x: ``[T, H]`` hidden states.
        topk_ids: ``[T, K]`` expert index of each of the token's K experts.
        topk_weights: ``[T, K]`` routing weight of each (already normalised as the model wants).
        token_lora: ``[T]`` adapter slot of each token, ``-1`` for none.
        w13, w2, w13_bias, w2_bias: base expert weights (layouts in the module doc).
        lora: stacked adapter weights, or None for the base layer alone.
        activation: ``"silu"`` or ``"swigluoai"``.
        compute_dtype: dtype of the arithmetic (e.g. ``torch.float64`` for a high-precision oracle).
    """
    dt = compute_dtype or x.dtype
    T, H = x.shape
    y = torch.zeros(T, H, dtype=dt, device=x.device)
    xc = x.to(dt)
    for t in range(T):
        a = int(token_lora[t])
        use_lora = lora is not None and a >= 0 and bool(lora.has_experts[a])
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            xt = xc[t : t + 1]
            gu = xt @ w13[e].to(dt).t()
            if w13_bias is not None:
                gu = gu + w13_bias[e].to(dt)
            if use_lora:
                s = lora.scaling[a].to(dt)
                gu = gu + lora_delta(xt, lora.w13_a[a, e].to(dt), lora.w13_b[a, e].to(dt), s)
            h = apply_activation(gu, activation)
            d = h @ w2[e].to(dt).t()
            if w2_bias is not None:
                d = d + w2_bias[e].to(dt)
            if use_lora:
                d = d + lora_delta(h, lora.w2_a[a, e].to(dt), lora.w2_b[a, e].to(dt), s)
            y[t] += topk_weights[t, k].to(dt) * d[0]
    return y.to(x.dtype)


def random_moe_lora_problem(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    num_slots: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    no_adapter_fraction: float = 0.25,
    slots_without_experts: tuple[int, ...] = (),
    with_bias: bool = False,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> dict:
    """Fresh random inputs for ``moe_lora_reference`` and the kernels under test (keyword dict).

    Magnitudes keep activations O(1) so relative errors are meaningful in bf16. A fraction of the
    tokens has no adapter (``-1``); slots listed in ``slots_without_experts`` carry zeros and
    ``has_experts=False``. Drawn from ``generator``, else from a generator seeded with ``seed``
    (one of the two is required: a problem can always be drawn again).
    """
    if generator is None:
        if seed is None:
            raise ValueError("random_moe_lora_problem needs a seed or a generator")
        generator = torch.Generator().manual_seed(seed)
    g = generator

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype=dtype, device=device)

    H, I, E, L, r = hidden, intermediate, num_experts, num_slots, rank
    logits = torch.randn(num_tokens, E, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    token_lora = torch.randint(0, L, (num_tokens,), generator=g)
    token_lora[torch.rand(num_tokens, generator=g) < no_adapter_fraction] = -1
    has_experts = torch.ones(L, dtype=torch.bool)
    lora = MoELoRAWeights(
        w13_a=rnd(L, E, r, H, std=H**-0.5),
        w13_b=rnd(L, E, 2 * I, r, std=r**-0.5),
        w2_a=rnd(L, E, r, I, std=I**-0.5),
        w2_b=rnd(L, E, H, r, std=r**-0.5),
        scaling=torch.full((L,), 0.5, dtype=torch.float32, device=device),
        has_experts=has_experts.to(device),
    )
    for s in slots_without_experts:
        for w in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b):
            w[s].zero_()
        lora.has_experts[s] = False
    return dict(
        x=rnd(num_tokens, H, std=1.0),
        topk_ids=ids.to(device=device, dtype=torch.int32),
        topk_weights=weights.to(device=device, dtype=torch.float32),
        token_lora=token_lora.to(device=device, dtype=torch.int32),
        w13=rnd(E, 2 * I, H, std=H**-0.5),
        w2=rnd(E, H, I, std=I**-0.5),
        w13_bias=rnd(E, 2 * I, std=0.1) if with_bias else None,
        w2_bias=rnd(E, H, std=0.1) if with_bias else None,
        lora=lora,
    )
