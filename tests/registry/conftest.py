"""What the registry tests share: the tiny base model's shapes and a fresh local store."""

from __future__ import annotations

import pytest

from adapters_registry.manifest import BaseModelInfo
from adapters_registry.stores import open_store
from tests.helpers.assets import tiny_assets


@pytest.fixture(scope="module")
def base() -> BaseModelInfo:
    return BaseModelInfo.from_model_dir(tiny_assets()["base"])


@pytest.fixture
def store(tmp_path):
    return open_store((tmp_path / "store").as_uri())
