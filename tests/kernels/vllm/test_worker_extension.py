"""The LoRA shape warm-up's input buffer: random ids over the vocabulary, so its dummy forwards
route tokens across experts as served batches do (not all to the experts of token 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.vllm.worker_extension import randomize_input_ids


class ModelConfig:
    def get_vocab_size(self) -> int:
        return 1000


@pytest.mark.parametrize("as_buffer", [True, False])
def test_input_ids_are_random_within_the_vocabulary(as_buffer):
    ids = torch.zeros(4096, dtype=torch.int32)
    runner = SimpleNamespace(input_ids=SimpleNamespace(gpu=ids) if as_buffer else ids, model_config=ModelConfig())
    randomize_input_ids(runner)
    assert ids.dtype == torch.int32 and 0 <= int(ids.min()) and int(ids.max()) < 1000
    assert len(torch.unique(ids)) > 900  # spread over the vocabulary, not one repeated id


def test_an_unknown_buffer_is_refused():
    with pytest.raises(RuntimeError, match="input_ids"):
        randomize_input_ids(SimpleNamespace(input_ids=[0] * 8, model_config=ModelConfig()))
