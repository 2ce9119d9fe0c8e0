"""``kernels.vllm.plugin.sync_debug_from_env``: PyTorch's CUDA sync debug mode behind
``LORAPLEX_SYNC_DEBUG``, never without the variable or without CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.vllm import plugin as vllm_plugin


@pytest.mark.parametrize("value,cuda,turned_on", [
    (None, True, False), ("0", True, False), ("1", True, True), ("yes", True, True),
    ("1", False, False)])
def test_sync_debug_mode_follows_the_variable(monkeypatch, value, cuda, turned_on):
    calls = []
    if value is None:
        monkeypatch.delenv(vllm_plugin.SYNC_DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.SYNC_DEBUG_ENV, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    assert vllm_plugin.sync_debug_from_env() is turned_on
    assert calls == (["warn"] if turned_on else [])
