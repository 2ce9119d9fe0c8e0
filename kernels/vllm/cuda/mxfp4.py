"""vLLM 0.24, MXFP4 experts (GPT-OSS) with LoRA: keep the Triton MXFP4 GEMMs, add LoRA beside.

Without LoRA, vLLM 0.24 on Hopper runs MXFP4 experts with ``OAITritonExperts`` (triton_kernels'
``matmul_ogs`` with the activation fused in). That class cannot take LoRA, so with LoRA enabled
the automatic choice falls through to Marlin, a slower base GEMM. vLLM also ships
``UnfusedOAITritonExperts``: the same ``matmul_ogs`` GEMMs with the activation and the top-k sum
as separate steps, where the LoRA deltas are added (through ``LoRAExpertsMixin``, i.e. through
loraplex's kernels once ``kernels.vllm.cuda.moe`` is installed); vLLM leaves it out of the automatic
order because of a bug with MTP speculative decoding.

``install`` wraps the MXFP4 backend selection used by vLLM's MXFP4 quantisation method: when
LoRA is enabled, the backend is left on automatic, no activation quantisation is requested, no
speculative decoding is configured and the unfused Triton class supports the configuration,
that class is chosen; otherwise vLLM's own choice stands. An explicit ``moe_backend`` always wins.

``install`` also replaces that class's ``apply`` by ``_apply_unfused``: the same two
``matmul_ogs`` GEMMs, activation, LoRA hooks and top-k sum, without vLLM's two row gathers.
vLLM's version writes the w13 GEMM's rows in expert-sorted order, copies them to token-pair order
for the LoRA hook and the activation (``y[gather.dst_indx]``, a ``[M*K, N]`` copy), then copies
the activation back to sorted order for the w2 GEMM (``[M*K, N/2]``). Here:

- A step without expert LoRA (no adapter, or none with expert weights) runs vLLM's fused Triton
  path — the activation inside the w13 GEMM, the top-k sum inside the w2 GEMM — as an engine
  without LoRA does, so enabling LoRA costs such steps nothing.
- When loraplex's ops take the layer (*sorted rows*): the w13 GEMM writes the expert-sorted rows
  as the LoRA-off GEMM does, loraplex's gate_up and down LoRA read and write them through the
  routing's row map (``gather.dst_indx``: pair ``t*K+k`` → sorted row;
  ``kernels.moe_lora.kernels``), GPT-OSS's activation is folded into the gate_up expand
  (``kernels.vllm.cuda.moe.unfused_gate_up``), the w2 GEMM reads the sorted rows and scatters its output to
  pair order (``n_expts_act = 1``: no fused top-k sum), then the LoRA down delta and
  ``moe_sum``. Both GEMMs launch through ``kernels.launch.kept_matmul_ogs`` (``matmul_ogs``'
  per-call preparation done once per shape). Scattering the w13 output to pair order
  instead costs its GEMM 19–24 µs per layer at decode sizes on an H200
  (``benchmarks/kernels/mxfp4_experts.py``); the sorted w13 GEMM costs what the fused one does.
- Otherwise (vLLM's own LoRA hooks, which need token-pair rows: *pair order*): the w13 GEMM
  gathers its input rows from the token ids of the sorted rows and scatters its output rows to
  their pair positions, and the w2 GEMM gathers its input rows from the pair positions; every
  tensor the hooks, the activation and ``moe_sum`` see is vLLM's, row for row.

The routing data comes from ``kernels.mxfp4.routing`` (the same data as vLLM's
``make_routing_data``, its inputs prepared in one launch instead of seven). Expert parallelism
(``expert_map``) and router weights applied to the input keep vLLM's own ``apply``.
"""

from __future__ import annotations

import torch

from kernels.launch.kept_matmul_ogs import kept_matmul_ogs
from kernels.vllm.cuda import live, moe
from kernels.vllm.cuda.oai import oai_module, unfused_class
from kernels.vllm.patching import Patches

_vllm: dict[str, object] = {}  # vLLM's own ``apply`` of the unfused class (the cases it keeps)


def _lora_choice(config, activation_key):
    """``(backend, experts class)`` for LoRA on MXFP4 experts, or None to defer to vLLM."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle

    vllm_config = get_current_vllm_config_or_none()
    if (not config.is_lora_enabled or config.moe_backend != "auto" or activation_key is not None
            or config.moe_parallel_config.use_batched_activation_format
            or (vllm_config is not None and vllm_config.speculative_config is not None)):
        return None
    try:
        return oracle._return_or_raise(oracle.Mxfp4MoeBackend.TRITON_UNFUSED, config,
                                       oracle.kMxfp4Static, None,
                                       mk.FusedMoEActivationFormat.Standard)
    except ValueError:  # not supported here (e.g. no triton_kernels, not Hopper/Blackwell)
        return None


def unfused_under_lora(select):
    """``select_mxfp4_moe_backend`` choosing the unfused Triton class under LoRA (``_lora_choice``),
    vLLM's ``select`` otherwise."""

    def select_mxfp4_moe_backend(config, activation_key=None):
        choice = _lora_choice(config, activation_key)
        if choice is None:
            return select(config, activation_key)
        _warm_up_routing(config)
        return choice

    return select_mxfp4_moe_backend


def _warm_up_routing(config) -> None:
    """Compiles ``kernels.mxfp4.routing``'s kernel for the layer's experts and top-k while the
    model is built (before vLLM's profile run and graph capture), so none compiles while
    serving (``kernels.vllm.cuda.warmup`` reports any that does)."""
    from kernels.mxfp4.routing import routing_inputs
    from kernels.vllm.cuda.warmup import compiling_on_purpose

    device = getattr(config, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return
    k = config.experts_per_token
    with compiling_on_purpose():
        routing_inputs(torch.zeros(1, k, dtype=torch.int32, device=device),
                       torch.zeros(1, k, dtype=torch.float32, device=device),
                       config.num_local_experts)


def _routing_data(experts, oai, topk_ids, topk_weights, num_experts):
    """``matmul_ogs``' routing data of the top-k: ``kernels.mxfp4.routing`` (the same data,
    its inputs prepared in one launch) with triton_kernels' v3.5 API, which vLLM 0.24 ships;
    vLLM's ``make_routing_data`` otherwise."""
    if getattr(oai, "use_legacy_triton_kernels", False):
        from kernels.mxfp4.routing import routing_data

        return routing_data(topk_ids, topk_weights, num_experts)
    return experts._make_routing_data(topk_ids, topk_weights, num_experts)


def _fused_applies(oai, activation, quant) -> bool:
    """Whether vLLM's fused Triton path computes what the unfused one would: the swiglu-OAI
    activation with the fused kernel's constants (``kernels.moe_math``'s alpha and limit,
    which the gate_up fold uses too)."""
    from kernels.moe_math import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

    return (activation == oai.MoEActivation.SWIGLUOAI
            and getattr(quant, "gemm1_alpha", None) in (None, SWIGLUOAI_ALPHA)
            and getattr(quant, "gemm1_clamp_limit", None) in (None, SWIGLUOAI_LIMIT))


def _apply_unfused(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                   global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                   workspace2, expert_tokens_meta, apply_router_weight_on_input):
    """``UnfusedOAITritonExperts.apply`` without the two row-gather copies (module docstring).

    ``hidden_states [M, H]`` bf16, ``w1`` / ``w2`` MXFP4 experts, ``topk_ids`` /
    ``topk_weights [M, K]``; ``output [M, H]``."""
    if expert_map is not None or apply_router_weight_on_input:
        return _vllm["apply"](self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                               activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                               workspace13, workspace2, expert_tokens_meta,
                               apply_router_weight_on_input)
    oai = oai_module()
    quant = self.quant_config or oai.FUSED_MOE_UNQUANTIZED_CONFIG
    top_k = topk_ids.size(1)
    routing, gather, scatter = _routing_data(self, oai, topk_ids, topk_weights, w1.shape[0])
    lora = self._lora_context
    swiglu_oai = _fused_applies(oai, activation, quant)
    if swiglu_oai and (lora is None or live.moe_step_idle(lora)):
        # no expert LoRA in this step: vLLM's fused path (activation in the w13 GEMM, top-k sum
        # in the w2 GEMM), as the engine runs without LoRA
        oai.triton_kernel_fused_experts(
            output, hidden_states, w1, w2, routing, gather, scatter, topk=top_k,
            activation=activation, quant_config=quant, global_num_experts=w1.shape[0],
            intermediate_cache=workspace13, a1q_scale=a1q_scale)
        return
    args = (self, oai, quant, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
            workspace13, workspace2, routing, gather, scatter)
    if lora is None or moe.takes_layer(lora, hidden_states):
        _sorted_rows(*args, swiglu_oai)
    else:
        _pair_order(*args)


def _sorted_rows(self, oai, quant, output, hidden_states, w1, w2, topk_weights, topk_ids,
                 activation, workspace13, workspace2, routing, gather, scatter, swiglu_oai):
    """The experts with loraplex's LoRA ops (or none) on expert-sorted rows: ``y13 [M*K, N]``
    and ``act [M*K, N']`` in the w13 GEMM's sorted order (pair ``t*K+k`` at
    ``gather.dst_indx[t*K+k]``), ``y2 [M*K, H]`` in pair order for the down LoRA and
    ``moe_sum``."""
    m, hidden = hidden_states.shape
    n, top_k = w1.shape[2], topk_ids.size(1)
    rows = m * top_k
    y13 = oai._resize_cache(workspace2, (1, rows, n))
    act = oai._resize_cache(workspace13, (rows, self.adjust_N_for_activation(n, activation)))
    y2 = oai._resize_cache(workspace2, (1, rows, hidden))  # y13 is dead once act is written
    matmul = kept_matmul_ogs(oai.matmul_ogs)
    matmul(hidden_states, w1, quant.w1_bias, routing, gather_indx=gather,
           precision_config=quant.w1_precision, y=y13)
    y13 = y13.view(rows, n)
    lora, step, act_done = self._lora_context, (None, None, None, None), False
    if lora is not None:
        step, act_done = moe.unfused_gate_up(lora, y13, act, hidden_states, topk_ids,
                                                   row_map=gather.dst_indx, swiglu=swiglu_oai)
    if not act_done:
        self.activation(activation, act, y13)
    routing.n_expts_act = 1  # one output row per (token, expert) pair: no fused top-k sum
    matmul(act, w2, quant.w2_bias, routing, scatter_indx=scatter,
           precision_config=quant.w2_precision, gammas=routing.gate_scal, y=y2)
    _down_and_sum(self, lora, step, output, y2, act, topk_weights, w1, w2, m, top_k)


def _pair_order(self, oai, quant, output, hidden_states, w1, w2, topk_weights, topk_ids,
                activation, workspace13, workspace2, routing, gather, scatter):
    """The experts with vLLM's LoRA hooks on token-pair ordered rows (row ``t*K+k`` of
    ``y13 [M*K, N]``, ``act [M*K, N']`` and ``y2 [M*K, H]``), as vLLM's hooks expect."""
    m, hidden = hidden_states.shape
    n, top_k = w1.shape[2], topk_ids.size(1)
    rows = m * top_k
    routing.n_expts_act = 1  # one output row per (token, expert) pair: no fused top-k sum
    # sorted row r reads token src_indx[r] // K (-1 padding stays in range, as in the kernel)
    token_gather = type(gather)(src_indx=torch.div(gather.src_indx, top_k, rounding_mode="trunc"),
                                dst_indx=gather.dst_indx)
    y13 = oai._resize_cache(workspace2, (1, rows, n))
    act = oai._resize_cache(workspace13, (rows, self.adjust_N_for_activation(n, activation)))
    y2 = oai._resize_cache(workspace2, (1, rows, hidden))  # y13 is dead once act is written
    oai.matmul_ogs(hidden_states, w1, quant.w1_bias, routing, gather_indx=token_gather,
                   scatter_indx=scatter, precision_config=quant.w1_precision, y=y13)
    y13 = y13.view(rows, n)
    lora = self._lora_context
    step = self.apply_w13_lora(lora, y=y13, x=hidden_states, topk_ids=topk_ids,
                               topk_weights=topk_weights, expert_map=None, w1=w1, w2=w2,
                               num_tokens=m, top_k_num=top_k)
    self.activation(activation, act, y13)
    oai.matmul_ogs(act, w2, quant.w2_bias, routing, gather_indx=gather, scatter_indx=scatter,
                   precision_config=quant.w2_precision, gammas=routing.gate_scal, y=y2)
    _down_and_sum(self, lora, step, output, y2, act, topk_weights, w1, w2, m, top_k)


def _down_and_sum(self, lora, step, output, y2, act, topk_weights, w1, w2, m, top_k) -> None:
    """The down LoRA hook into ``y2 [1, M*K, H]`` (pair order; ``act``'s rows as the gate_up
    step left them) and the top-k sum into ``output [M, H]``."""
    hidden = output.shape[1]
    if lora is not None:
        self.apply_w2_lora(lora, y=y2.view(m, top_k, hidden), x=act, topk_weights=topk_weights,
                           sorted_token_ids_lora=step[0], expert_ids_lora=step[1],
                           num_tokens_post_padded_lora=step[2], token_lora_mapping=step[3],
                           num_tokens=m, w1=w1, w2=w2, top_k_num=top_k)
    self.moe_sum(y2.view(m, top_k, hidden), output)


def install_backend_choice(patches: Patches) -> None:
    """Wraps ``select_mxfp4_moe_backend`` as the MXFP4 method looks it up."""
    from vllm.model_executor.layers.quantization import mxfp4

    patches.wrap(mxfp4, "select_mxfp4_moe_backend", unfused_under_lora)


def install(patches: Patches) -> None:
    """``install_backend_choice`` and the unfused Triton class's ``apply`` replaced by
    ``_apply_unfused`` (the caller checks the vLLM version)."""
    install_backend_choice(patches)
    cls = unfused_class()
    if cls is not None:
        _vllm["apply"] = patches.replace(cls, "apply", _apply_unfused)
