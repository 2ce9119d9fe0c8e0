"""vLLM 0.24 on CUDA: loraplex's Triton dense LoRA ops behind punica's ``add_lora_linear``.

LoRA-wrapped linear layers (o, a router, single projections) end in
``PunicaWrapperGPU.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale,
output_slices)``: ``y[:, slice i] += scale * x A_i^T B_i^T`` per token's slot; merged ones
(q/k/v, gate/up) in ``column_parallel_linear._mcp_apply``, which with one tensor-parallel rank is
routed to ``add_lora_linear`` too. vLLM runs it as a
zero-fill, a split-K shrink with atomics and an expand (three launches, default tiles). Ours
(``kernels.dense_lora.launch``) is two launches, PDL-overlapped, no zero-fill, reading the same
per-step metadata vLLM prepares outside CUDA graphs (tokens grouped by slot in
``token_mapping_meta``), so it is CUDA-graph safe exactly as vLLM's is. loraplex's punica wrapper
(``kernels.vllm.cuda.punica``) calls ``add_lora_linear`` here for the calls ``supported`` takes.

Modules that no adapter of the step targets are skipped in steps without CUDA graphs; inside
graphs their programs exit at once, reading the module's per-slot rank table
(``kernels.vllm.cuda.live``), which also bounds the A rows / B columns read to each adapter's
rank. Neither when the op overwrites (``add_inputs=False``): those rows must still be written.

Per layer shape the first call (vLLM's profile run, before graph capture and serving) compiles
every variant the batch-size buckets can launch (tiles tuned per device in
``kernels/configs/dense_lora_<device>.json``, else heuristic: ``kernels.dense_lora.configs``), so
no compile happens while serving. Cases vLLM's own path keeps: more than three slices, dtypes
other than bf16/fp16, non-CUDA tensors.
"""

from __future__ import annotations

import torch

from kernels.vllm.cuda import live
from kernels.vllm.cuda.warmup import compiling_on_purpose
from kernels.vllm.patching import Patches

_vllm: dict[str, object] = {}  # vLLM's own ``_mcp_apply``, for tensor parallelism
# (A data_ptr, B data_ptr, slices) -> warmed-up layer (``DenseLoRALayer``: 3-D views of the
# stacks, nothing copied, its launch pairs kept per token count)
_layers: dict[tuple, object] = {}
_warmed_shapes: set[tuple] = set()  # (A shapes, B shapes, dtype, device) compiled for


def supported(lora_a_stacked, lora_b_stacked, x: torch.Tensor) -> bool:
    """Whether our ops take this call (static properties only: traced by torch.compile)."""
    from kernels.dense_lora.launch import MAX_SLICES

    a0 = lora_a_stacked[0]
    return (1 <= len(lora_a_stacked) <= MAX_SLICES
            and len(lora_b_stacked) == len(lora_a_stacked)
            and a0.is_cuda and a0.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == a0.dtype
            and all(t.is_contiguous() for t in (*lora_a_stacked, *lora_b_stacked))
            and all(t.shape == a0.shape for t in lora_a_stacked))


def _layer(lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]):
    from kernels.dense_lora.layer import DenseLoRALayer

    key = (lora_a[0].data_ptr(), lora_b[0].data_ptr(), len(lora_a))
    layer = _layers.get(key)
    if layer is None:
        layer = DenseLoRALayer(lora_a, lora_b)
        shape = (tuple(t.shape for t in layer.a), tuple(t.shape for t in layer.b),
                 layer.a[0].dtype, layer.a[0].device)
        if shape in _warmed_shapes or _warm_up(layer):  # variants compile once per shape
            _warmed_shapes.add(shape)
            _layers[key] = layer
    return layer


def _warm_up(layer) -> bool:
    """Compiles the variants of every M bucket for this layer (zero inputs, scratch output);
    never under CUDA-graph capture (returns False then)."""
    from kernels.dense_lora.groups import group_tokens
    from kernels.dense_lora.launch import dense_lora_expand, dense_lora_shrink
    from kernels.lora_tiles import pdl_supported

    dev = layer.a[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    dtype = layer.a[0].dtype
    slots = layer.a[0].shape[0]
    out = sum(t.shape[-2] for t in layer.b)
    every_slot = torch.ones(slots, dtype=torch.int32, device=dev)
    with compiling_on_purpose():
        for m, cfg in layer.warm_up_configs():
            groups = group_tokens(torch.arange(m, device=dev, dtype=torch.int32) % slots,
                                  slots + 1)
            x = torch.zeros(m, layer.in_features, dtype=dtype, device=dev)
            y = torch.zeros(m, out, dtype=dtype, device=dev)
            pdl = pdl_supported(x)
            for add_inputs, slot_live in ((True, None), (False, None), (True, every_slot)):
                part = dense_lora_shrink(x, layer.a, groups, cfg, use_pdl=pdl,
                                         slot_live=slot_live)
                dense_lora_expand(y, part, layer.b, groups, cfg, add_inputs, use_pdl=pdl,
                                  slot_live=slot_live)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return True


def dense_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                      lora_b: list[torch.Tensor], scale: float, add_inputs: bool,
                      sorted_idx: torch.Tensor, group_slot: torch.Tensor,
                      group_ntok: torch.Tensor, group_start: torch.Tensor,
                      no_lora_flag_cpu: torch.Tensor) -> None:
    """The op (registered as ``torch.ops.vllm.loraplex_dense_lora_linear``, opaque to
    torch.compile): ``y [M, >=sum(N)] (+)= scale * x [M, in] A_i^T B_i^T`` per slice for the
    tokens grouped by slot in the metadata; nothing when the step has no adapter."""
    from kernels.dense_lora.groups import TokenGroups
    from kernels.lora_tiles import pdl_supported

    if bool(no_lora_flag_cpu.item()):  # a CPU tensor: no device sync
        return
    mask = None
    if add_inputs:  # (overwriting must write zeros for slots without weights: not skipped)
        if live.skippable(lora_a[0]):  # no adapter of this step targets the layer
            return
        # per slot its adapter's rank here: programs of slots at 0 exit (inside graphs too),
        # the others read A rows / B columns up to it
        mask = live.slot_ranks(lora_a[0])
    layer = _layer(lora_a, lora_b)
    m = x.shape[0]
    groups = TokenGroups(sorted_idx, group_slot, group_ntok, group_start, m)
    layer(y, x, groups, layer.config(m), scale, add_inputs, pdl_supported(x), mask)


def _dense_lora_linear_fake(y, x, lora_a, lora_b, scale, add_inputs, sorted_idx, group_slot,
                            group_ntok, group_start, no_lora_flag_cpu) -> None:
    return None


def add_lora_linear(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale,
                    add_inputs: bool = True) -> None:
    """``PunicaWrapperGPU.add_lora_linear`` through loraplex's dense ops (same semantics), for
    the calls ``supported`` takes; the step's token groups come from ``wrapper``'s metadata."""
    meta = wrapper.token_mapping_meta
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    torch.ops.vllm.loraplex_dense_lora_linear(
        y.view(-1, y.shape[-1]), x2, list(lora_a_stacked), list(lora_b_stacked), float(scale),
        bool(add_inputs), meta.token_indices_sorted_by_lora_ids[:m], meta.active_lora_ids,
        meta.num_tokens_per_lora, meta.lora_token_start_loc, meta.no_lora_flag_cpu)


def _mcp_apply(x, bias, layer):
    """vLLM's column-parallel LoRA apply (merged gate_up, merged q/k/v), which zero-fills a
    buffer and calls shrink and expand itself (for the all-gather between them under tensor
    parallelism). With one rank the gather is the identity, so the layer goes through
    ``add_lora_linear``, i.e. our ops; otherwise vLLM's own."""
    if layer.tp_size != 1:
        return _vllm["_mcp_apply"](x, bias, layer)
    output = layer._get_quant_method().apply(layer.base_layer, x, bias)
    x2 = x.view(-1, x.shape[-1])
    out2, shape = output.view(-1, output.shape[-1]), output.shape
    layer.punica_wrapper.add_lora_linear(out2, x2, layer.lora_a_stacked, layer.lora_b_stacked,
                                         1.0, layer.output_slices)
    return out2.view(*shape)


def _register_op() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, "loraplex_dense_lora_linear"):
        direct_register_custom_op(op_name="loraplex_dense_lora_linear",
                                  op_func=dense_lora_linear, mutates_args=["y"],
                                  fake_impl=_dense_lora_linear_fake)


def install(patches: Patches) -> None:
    """Registers the op and routes one-rank column-parallel LoRA through ``add_lora_linear``
    (the caller checks the vLLM version)."""
    from vllm.lora.layers import column_parallel_linear

    _register_op()
    _vllm["_mcp_apply"] = patches.replace(column_parallel_linear, "_mcp_apply", _mcp_apply)


def reset() -> None:
    """Forgets the layers (after the patches are undone)."""
    _layers.clear()
    _vllm.clear()
