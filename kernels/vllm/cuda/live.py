"""Which LoRA modules a step can skip: no adapter of the step carries weights for them.

vLLM runs every LoRA-wrapped module's ops for every step that has any adapter, also modules no
resident adapter targets (GPT-OSS's router when adapters cover attention and experts; the
experts when an adapter covers attention only): their weights are zero, the result unchanged,
the launches paid. In a step without CUDA graphs (prefill) that is host time per module.

Two facts, kept on the host:

- per module, the slots whose current adapter has weights for it (``activate_adapter`` copies
  an adapter's weights into a slot, or resets the module's slot when it has none; wrapped);
- per step, the slots its tokens use (``record_step``, called by loraplex's punica wrapper's
  ``update_metadata``, once per step, outside CUDA graphs).

``skippable(first_a_stack)`` is true when the two do not meet; ``covers_all_tokens`` when every
token of the step is on a slot with weights for the module (the MXFP4 experts then skip the
kernel for rows without expert LoRA). Never while a CUDA graph is
being captured (the graph must hold the launches for later steps) and never for a module whose
slots were not tracked. Keys are the data pointers of the modules' first A stacks (allocated
once at model load).

Inside CUDA graphs (decode) the launches stay, but they need not work: per module a device
table ``slot_ranks(first_a_stack) [L]`` int32 (the rank of the slot's adapter for this module,
0: no weights here) is kept in step with the first fact, written in place (outside graphs, when
an adapter is activated; its address never changes). The dense kernels' programs for slots at 0
exit at once, and the dense and MoE kernels read a slot's A rows and B columns only up to its
adapter's rank: vLLM sizes the stacks for ``max_lora_rank`` and zeroes them past the adapter's
rank, so a rank-32 adapter in a rank-64 engine would otherwise move twice its bytes every step.
vLLM activates its dummy adapters before capturing graphs, so every module has its table by
then.
"""

from __future__ import annotations

import torch

from kernels.vllm.patching import Patches

_tracking = [False]  # activate_adapter is wrapped: the facts below are kept
_live: dict[int, set[int]] = {}  # module key -> slots whose adapter has weights there
# slots this step's tokens use; its token count; whether every token is on a resident adapter
_step: dict[str, object] = {"slots": None}
_ranks: dict[int, torch.Tensor] = {}  # module key -> [L] int32 device table: rank per slot


def first_a_stack(module) -> tuple[torch.Tensor | None, bool]:
    """``(first A stack, is an MoE module)`` of a LoRA module (``None``: not a LoRA module)."""
    def present(stacks) -> bool:
        return stacks is not None and (isinstance(stacks, torch.Tensor) or len(stacks) > 0)

    stacks = getattr(module, "w13_lora_a_stacked", None)
    moe = present(stacks)
    if not moe:
        stacks = getattr(module, "lora_a_stacked", None)
        if not present(stacks):
            return None, False
    return (stacks if isinstance(stacks, torch.Tensor) else stacks[0]), moe


def module_key(module) -> int | None:
    """The key of a LoRA module: data pointer of its first A stack (None: not a LoRA module)."""
    first, _ = first_a_stack(module)
    return None if first is None else first.data_ptr()


def record_slot(manager, index: int, lora_model) -> None:
    """After ``activate_adapter`` put ``lora_model`` in slot ``index``: per module, whether
    that slot now holds weights, and their rank."""
    for name, module in manager.modules.items():
        first, _ = first_a_stack(module)
        if first is None:
            continue
        key = first.data_ptr()
        live = _live.setdefault(key, set())
        weights = manager._get_lora_layer_weights(lora_model, name)
        if weights:
            live.add(index)
        else:
            live.discard(index)
        experts = first.shape[1] if first.dim() == 4 else 1  # [L, E or 1, r, in]
        rank = adapter_rank(weights, first.shape[-2], experts) if weights else 0
        _write_rank(key, first, index, rank)


def adapter_rank(weights, stack_rank: int, num_experts: int = 1) -> int:
    """The rank a slot's stack holds for a module's LoRA weights (vLLM's ``LoRALayerWeights``,
    packed or not), at most the stack's: the kernels read that many A rows and B columns, so it
    may never be less than what vLLM copies into the slot. The largest of the weights' ``rank``
    (the adapter config's) and the rows of every ``A`` part as vLLM lays them out — ``[r, in]``,
    ``[E, r, in]``, or the fused experts' ``[E*r, in]`` (``num_experts`` E: the stack's second
    dimension, 1 for dense modules); a part of any other shape reads the stack's whole rank."""
    rank = getattr(weights, "rank", None)
    ranks = [rank] if isinstance(rank, int) and rank > 0 else []
    parts = weights.lora_a if isinstance(weights.lora_a, (list, tuple)) else [weights.lora_a]
    for a in parts:
        if not isinstance(a, torch.Tensor):
            continue
        if a.dim() == 3:
            ranks.append(a.shape[-2])
        elif a.dim() == 2 and a.shape[0] % num_experts == 0:
            ranks.append(a.shape[0] // num_experts)
        else:
            return stack_rank
    return min(max(ranks), stack_rank) if ranks else stack_rank


def _write_rank(key: int, first: torch.Tensor, index: int, rank: int) -> None:
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # never written from inside a graph (vLLM activates adapters outside them)
    # vLLM activates its dummy adapters under inference mode (warm-up), a served one outside it
    # (the add_lora RPC): a tensor made in inference mode may be written in place only inside it
    with torch.inference_mode():
        ranks = _ranks.get(key)
        if ranks is None:
            ranks = _ranks[key] = torch.zeros(first.shape[0], dtype=torch.int32,
                                              device=first.device)
        if 0 <= index < ranks.shape[0]:
            ranks[index] = rank


def tracking() -> bool:
    """Whether slots are tracked (``install`` ran): the MoE ops then read ``slot_ranks``."""
    return _tracking[0]


def slot_ranks(first_a_stack: torch.Tensor) -> torch.Tensor | None:
    """The device table of a module (``[L]`` int32: the rank of the slot's adapter for it, 0
    where it has no weights), or None when the module is not tracked."""
    return _ranks.get(first_a_stack.data_ptr()) if _tracking[0] else None


def record_step(index_mapping, lora_index_to_id) -> None:
    """The slots of this step's tokens (``index_mapping``: adapter id per token, 0 none), how
    many tokens it has, and whether every one of them is on a resident adapter."""
    ids = set(index_mapping)
    resident = {i for i in ids if i > 0 and i in lora_index_to_id}
    _step["slots"] = frozenset(lora_index_to_id.index(i) for i in resident)
    _step["tokens"] = len(index_mapping)
    _step["every"] = resident == ids


def covers_all_tokens(first_a_stack: torch.Tensor, num_tokens: int) -> bool:
    """True when every one of the step's ``num_tokens`` tokens is on an adapter with weights
    for the module of ``first_a_stack`` (a kernel for the rows without LoRA has nothing to
    do). False when unknown: no step recorded, a row count other than the step's tokens (rows
    padded for a graph), an untracked module, or while a CUDA graph is captured."""
    live = _live.get(first_a_stack.data_ptr())
    slots = _step["slots"]
    if (live is None or slots is None or not _step.get("every")
            or _step.get("tokens") != num_tokens or not slots <= live):
        return False
    return not (first_a_stack.is_cuda and torch.cuda.is_current_stream_capturing())


def skippable(first_a_stack: torch.Tensor) -> bool:
    """True when no slot of this step has weights for the module of ``first_a_stack``."""
    live = _live.get(first_a_stack.data_ptr())
    slots = _step["slots"]
    if live is None or slots is None or not live.isdisjoint(slots):
        return False
    return not (first_a_stack.is_cuda and torch.cuda.is_current_stream_capturing())


def moe_step_idle(ctx) -> bool:
    """True when no token of this step has expert LoRA in the MoE layer of vLLM's LoRA context
    ``ctx``: the step has no adapter (vLLM's no-LoRA flag, a CPU tensor, so no device sync;
    vLLM captures CUDA graphs with and without LoRA separately), or no adapter of the step has
    expert weights here (``skippable``: outside graph capture only)."""
    return (bool(ctx.punica_wrapper.token_mapping_meta.no_lora_flag_cpu.item())
            or skippable(ctx.w13_lora_a_stacked[0]))


def recording_slots(activate_adapter):
    """``LoRAModelManager.activate_adapter`` followed by ``record_slot`` of what it activated."""

    def activate_adapter_and_record(self, lora_id: int) -> bool:
        done = activate_adapter(self, lora_id)
        if done:
            record_slot(self, self.lora_index_to_id.index(lora_id),
                        self._registered_adapters[lora_id])
        return done

    return activate_adapter_and_record


def install(patches: Patches) -> None:
    """Wraps ``LoRAModelManager.activate_adapter`` (the caller checks the vLLM version)."""
    from vllm.lora.model_manager import LoRAModelManager

    patches.wrap(LoRAModelManager, "activate_adapter", recording_slots)
    _tracking[0] = True


def reset() -> None:
    """Forgets what was tracked (after the patches are undone)."""
    _tracking[0] = False
    _live.clear()
    _ranks.clear()
    _step["slots"] = None
