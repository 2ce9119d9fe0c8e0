"""``kernels.vllm_cuda_mapping.convert_mapping`` gives what vLLM 0.24's loop gives: same
tensors, dtypes and lengths (on the CPU here; the engine calls it with the GPU device), and the
same error for an id no slot holds. The oracle restates vLLM 0.24's semantics token by token."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kernels.vllm_cuda_mapping import NUMPY_FROM, _slot_of, convert_mapping, slot_indices

pytest.importorskip("vllm")


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
