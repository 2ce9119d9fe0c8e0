"""A dense LoRA layer applied through the Triton ops of ``kernels.dense_lora.launch``, with the
launch pair of each token count kept on the layer (what the vLLM integration calls per LoRA
linear layer and step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.dense_lora.configs import layer_dense_config, warm_up_configs
from kernels.dense_lora.groups import TokenGroups
from kernels.dense_lora.launch import (
    DenseLoRAConfig,
    as_3d,
    expand_with_plan,
    fused_with_plan,
    plan_tokens,
    shrink_with_plan,
)
from kernels.launch.cached import PlanTable, aligned16, raw_stream


class DenseLoRALayer:
    """One dense LoRA layer's stacks (per slice ``A [L, 1, r, in]``, ``B [L, 1, N_i, r]`` or
    3-D), applied as shrink + expand: ``layer(y, x, groups, cfg, ...)``.

    The layer keeps the prepared launch pair of each token-count bucket it has run
    (``plan_tokens``; at most ``MAX_CALLS``): a later call of the bucket checks one key and the
    16-byte alignment of the step's tensors, then launches both (what a prefill step, which has
    no CUDA graph, pays per layer).
    Nothing of a call is kept (``PreparedLaunch``); the weights are the layer's own.
    """

    MAX_CALLS = 64

    def __init__(self, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]) -> None:
        self.a, self.b = as_3d(lora_a), as_3d(lora_b)
        n = len(self.a)
        self.a3 = (self.a[0], self.a[min(1, n - 1)], self.a[-1])
        self.b3 = (self.b[0], self.b[min(1, n - 1)], self.b[-1])
        self.in_features = self.a[0].shape[-1]
        self.aligned = aligned16(*self.a, *self.b)
        self._calls = PlanTable(self.MAX_CALLS)
        dev = self.a[0].device
        index = (dev.index if dev.index is not None else torch.cuda.current_device()) \
            if dev.type == "cuda" else None
        # (in_features, out features per slice, rank, slots, CUDA device index): config lookup
        self.config_key = (self.in_features, tuple(t.shape[-2] for t in self.b),
                           self.a[0].shape[-2], self.a[0].shape[0], index)

    def config(self, m: int) -> DenseLoRAConfig:
        """The tiles for ``m`` tokens (``kernels.dense_lora.configs``: tuned or heuristic)."""
        return layer_dense_config(m, *self.config_key)

    def warm_up_configs(self) -> list[tuple[int, DenseLoRAConfig]]:
        """``[(M, config)]`` covering every config this layer can run with."""
        return warm_up_configs(*self.config_key)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, groups: TokenGroups,
                 cfg: DenseLoRAConfig, scale: float = 1.0, add_inputs: bool = True,
                 use_pdl: bool = False, slot_live: torch.Tensor | None = None) -> None:
        """``y [M, >=sum(N)] (+)= scale * x [M, in] A_i^T B_i^T`` per slice, as
        ``dense_lora_shrink`` + ``dense_lora_expand`` (``cfg.fused``: ``dense_lora_fused``, one
        launch, kept the same way)."""
        g = groups
        live = g.slot if slot_live is None else slot_live
        key = (plan_tokens(g.num_tokens), cfg, scale, add_inputs, use_pdl, slot_live is not None,
               x.stride(0), y.stride(0), x.dtype, y.dtype, g.slot.shape[0])
        call = self._calls.get(key)
        tensors_aligned = aligned16(x, y, g.sorted_idx, g.slot, g.ntok, g.start, live)
        meta = (g.sorted_idx, g.slot, g.ntok, g.start, live, g.num_groups, g.num_tokens)
        if call is not None and tensors_aligned:
            stream = raw_stream(x.device)
            if cfg.fused:
                call[0].launch(stream, y, x, *self.a3, *self.b3, *meta)
                return
            shrink, expand = call
            part = torch.empty(shrink.extra, dtype=torch.float32, device=x.device)
            shrink.launch(stream, x, *self.a3, part, *meta)
            expand.launch(stream, y, *self.b3, part, *meta)
            return
        if cfg.fused:
            call = (fused_with_plan(y, x, self.a, self.b, g, cfg, scale, add_inputs, slot_live),)
        else:
            part, shrink = shrink_with_plan(x, self.a, g, cfg, scale, use_pdl, slot_live)
            call = (shrink, expand_with_plan(y, part, self.b, g, cfg, add_inputs, use_pdl,
                                             slot_live))
        if None not in call and self.aligned and tensors_aligned:
            self._calls.put(key, call)
