"""``kernels.vllm.cuda.mapping``: ``convert_mapping`` gives what vLLM 0.24's loop gives (same
tensors, dtypes and lengths; on the CPU here, the engine calls it with the GPU device) and the
same error for an id no slot holds — the oracle restates vLLM 0.24's semantics token by token;
``prepare_kernel_meta`` / ``update_metadata`` fill the LoRA kernels' metadata as vLLM's own
``LoRAKernelMeta.prepare_tensors`` does from the device copy (the installed vLLM is the oracle,
on CPU tensors)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kernels.vllm.cuda.mapping import (
    NUMPY_FROM,
    _slot_of,
    convert_mapping,
    host_slots,
    prepare_kernel_meta,
    slot_indices,
    update_metadata,
)


def loop_oracle(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size):
    """vLLM 0.24's ``convert_mapping``, one token at a time (``list.index`` per token)."""
    ids = list(mapping.index_mapping)
    lora = [lora_index_to_id.index(x) if x > 0 else -1 for x in ids]
    embedding = [s if x > 0 else 0 for x, s in zip(ids, lora)]
    prompt = [lora_index_to_id.index(x) if x > 0 else -1 for x in mapping.prompt_mapping]
    indices = torch.tensor([ids, lora, embedding], dtype=torch.long)
    emb = torch.stack([indices[2] * extra_vocab_size,
                       indices[2] * (vocab_size + extra_vocab_size)])
    emb = torch.where(emb == -1, max_loras - 1, emb)
    sampler = torch.tensor(prompt, dtype=torch.long)
    padded = torch.where(sampler == -1, max_loras - 1, sampler)
    padded = torch.arange(len(padded), dtype=torch.long) + padded * len(padded)
    return indices[1], sampler, padded, emb, [len(ids), len(prompt), len(prompt), len(ids)]


@pytest.mark.parametrize("tokens,requests", [(1, 1), (37, 5), (NUMPY_FROM, 3), (1616, 16),
                                             (0, 0)])
def test_matches_the_per_token_loop(tokens, requests):
    rng = random.Random(tokens)
    lora_index_to_id = [None, 41, 7, None, 1009, 3, 7, 12]  # 7 twice: the first slot counts
    live = [i for i in lora_index_to_id if i is not None]
    ids = tuple(rng.choice(live + [0, 0, -1]) for _ in range(tokens))
    prompt = tuple(rng.choice(live + [0]) for _ in range(requests))
    mapping = SimpleNamespace(index_mapping=ids, prompt_mapping=prompt)
    got = convert_mapping(mapping, lora_index_to_id, 8, 32000, 0, torch.device("cpu"))
    want = loop_oracle(mapping, lora_index_to_id, 8, 32000, 0)
    for g, w in zip(got[:4], want[:4]):
        assert g.dtype == w.dtype == torch.long and torch.equal(g, w)
    assert got[4] == want[4]


@pytest.mark.parametrize("tokens", [2, NUMPY_FROM])
def test_unknown_adapter_id_raises_like_vllm(tokens):
    mapping = SimpleNamespace(index_mapping=(3,) * (tokens - 1) + (5,), prompt_mapping=(3,))
    with pytest.raises(ValueError):
        convert_mapping(mapping, [None, 3], 2, 100, 0, torch.device("cpu"))


def test_slot_indices_first_position_and_no_adapter():
    import numpy as np

    slot_of = _slot_of([None, 7, 3, 7])
    ids = [7, 0, -1, 7, 3]
    assert slot_indices(np.array(ids, dtype=np.int64), slot_of).tolist() == [1, -1, -1, 1, 2]
    assert slot_indices(ids, slot_of) == [1, -1, -1, 1, 2]


def kernel_meta(captured=None):
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    return LoRAKernelMeta.make(max_loras=8, max_num_tokens=2048, device="cpu",
                               captured_lora_counts=captured)


def assert_same_meta(got, want, n: int) -> None:
    if not bool(want.no_lora_flag_cpu[0]):  # (without LoRA neither writes the token buffers)
        assert torch.equal(got.token_lora_mapping[:n], want.token_lora_mapping[:n])
        assert torch.equal(got.token_indices_sorted_by_lora_ids[:n],
                           want.token_indices_sorted_by_lora_ids[:n])
    for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc",
                 "no_lora_flag_cpu", "num_active_loras_cpu"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("slots,captured", [
    ([-1, -1, -1], None), ([], None), ([2], None), ([3, -1, 0, 3, 5, 0, -1, 7], None),
    ([3, -1, 0, 3, 5, 0, -1, 7], [1, 2, 4, 8]), ([1] * 5 + [0] * 3, [1, 2, 4, 8]),
    (list(range(8)) * 200, [1, 2, 4])])
def test_kernel_meta_equals_vllms_from_the_device_copy(slots, captured):
    got, want = kernel_meta(captured), kernel_meta(captured)
    for meta in (got, want):  # stale values from an earlier step: both must reset them
        meta.active_lora_ids.fill_(5)
        meta.num_tokens_per_lora.fill_(9)
        meta.no_lora_flag_cpu.fill_(True)
    want.prepare_tensors(torch.tensor(slots, dtype=torch.long))
    prepare_kernel_meta(got, slots)
    assert_same_meta(got, want, len(slots))


def test_update_metadata_fills_the_base_indices_and_both_metas_from_the_host_slots():
    """The whole step as loraplex's punica wrapper runs it: the base indices (vLLM 0.24's
    ``_update_base_metadata`` semantics, the loop oracle) in the wrapper's own buffers, and
    both kernel metas as vLLM prepares them from the device copies."""
    lora_index_to_id = [None, 41, 7, None, 1009, 3, 7, 12]
    rng = random.Random(5)
    ids = tuple(rng.choice([41, 7, 0, 1009, 12]) for _ in range(NUMPY_FROM + 9))
    mapping = SimpleNamespace(index_mapping=ids, prompt_mapping=(41, 0, 12), is_prefill=True)
    # vLLM 0.24's ``PunicaWrapperBase`` buffers (2048 tokens, 16 requests)
    wrapper = SimpleNamespace(
        device=torch.device("cpu"), _token_lora_indices=torch.full((2048,), 99),
        _sampler_indices=torch.full((16,), 99), _sampler_indices_padded=torch.full((16,), 99),
        _embeddings_indices=torch.full((2, 2048), 99), indices_len=[None] * 4,
        token_mapping_meta=kernel_meta(), prompt_mapping_meta=kernel_meta())
    update_metadata(wrapper, mapping, lora_index_to_id, 8, 32000)
    assert wrapper.is_prefill
    base, sampler, padded, emb, lengths = loop_oracle(mapping, lora_index_to_id, 8, 32000, 0)
    n, r = len(ids), 3
    assert torch.equal(wrapper._token_lora_indices[:n], base)
    assert torch.equal(wrapper._sampler_indices[:r], sampler)
    assert torch.equal(wrapper._sampler_indices_padded[:r], padded)
    assert torch.equal(wrapper._embeddings_indices[:2, :n], emb)
    assert list(wrapper.indices_len) == lengths
    want_tokens, want_prompts = kernel_meta(), kernel_meta()
    want_tokens.prepare_tensors(base)  # what vLLM prepares from the device copies
    want_prompts.prepare_tensors(sampler)
    assert_same_meta(wrapper.token_mapping_meta, want_tokens, n)
    assert_same_meta(wrapper.prompt_mapping_meta, want_prompts, r)


def test_host_slots_are_computed_once_per_step():
    lora_index_to_id = [None, 3, 5]
    first = SimpleNamespace(index_mapping=(3, 5, 0), prompt_mapping=(3,))
    got = host_slots(first, lora_index_to_id)
    assert got[1] == [1, 2, -1] and got[2] == [1]
    assert host_slots(first, lora_index_to_id) is got
    assert host_slots(first, [None, 5, 3])[1] == [2, 1, -1]  # slots moved: recomputed
    second = SimpleNamespace(index_mapping=(3, 5, 0), prompt_mapping=(3,))
    assert host_slots(second, [None, 5, 3]) is not got
