"""Shared fixtures: the embedded default built once, and one real serving stack per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def loraplex_home(tmp_path_factory) -> Path:
    """A data dir holding the embedded default (`loraplex init`)."""
    from app.embedded.setup import init

    home = tmp_path_factory.mktemp("loraplex-home")
    init(home, progress=False)
    return home


@pytest.fixture(scope="session")
def embedded_model_dir(loraplex_home) -> Path:
    from app.embedded.setup import model_dir

    return model_dir(loraplex_home)


@pytest.fixture(scope="session")
def demo_adapter_sources(tmp_path_factory, embedded_model_dir) -> dict[str, Path]:
    """The demo adapters as PEFT wrote them (rebuilt from their seeds: same bytes as `init`'s)."""
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.setup import DEMO_ADAPTERS

    root = tmp_path_factory.mktemp("demo-adapters")
    return {
        s.adapter_id: build_peft_adapter(embedded_model_dir, root / s.adapter_id, s.kind, s.rank, s.seed)
        for s in DEMO_ADAPTERS
    }


@pytest.fixture(scope="session")
def serve_stack(loraplex_home, tmp_path_factory):
    """The real stack (`loraplex serve`: Ray Serve + vLLM-CPU) on a free loopback port."""
    from tests.stack import start_stack, stop_stack

    stack = start_stack(loraplex_home, tmp_path_factory.mktemp("stack"))
    yield stack
    stop_stack(stack)
