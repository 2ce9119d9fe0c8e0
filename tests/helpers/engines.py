"""Engine test doubles for the registry's slot table: the two ``AsyncLLM`` LoRA methods it calls,
recorded, with the invariants a real engine relies on checked on every call."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from adapters_registry.manifest import WEIGHTS_NAME


class RecordingEngine:
    """Records add/remove calls; fails loudly if the table ever drifts from the engine."""

    def __init__(self, capacity: int, refuse: set[str] | None = None):
        self.capacity = capacity
        self.registered: dict[int, tuple[str, str]] = {}  # lora_int_id -> (lora_name, path)
        self.calls: list[tuple] = []
        self.refuse = refuse or set()  # table names (``<id>@v<version>``), as decline
        self.decline: set[str] = set()

    async def add_lora(self, req) -> bool:
        await asyncio.sleep(random.random() * 0.005)
        assert (Path(req.lora_path) / WEIGHTS_NAME).is_file(), "registered a folder without weights"
        assert req.lora_int_id not in self.registered, "lora_int_id reused"
        assert len(self.registered) < self.capacity, "engine over capacity: its own LRU would evict (drift)"
        self.calls.append(("add", req.lora_name, req.lora_int_id))
        if _table_name(req.lora_name) in self.refuse:
            raise ValueError("engine says no")
        if _table_name(req.lora_name) in self.decline:
            return False
        self.registered[req.lora_int_id] = (req.lora_name, req.lora_path)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        await asyncio.sleep(random.random() * 0.005)
        self.calls.append(("remove", lora_int_id))
        entry = self.registered.pop(lora_int_id, None)
        if entry is not None:
            assert Path(entry[1]).is_dir(), "folder deleted while the engine still had it registered"
        return entry is not None

    def names(self) -> set[str]:
        """Registered versions as the table names them (``<id>@v<version>``: the engine-side
        name's content tag dropped)."""
        return {_table_name(n) for n, _ in self.registered.values()}


def _table_name(engine_name: str) -> str:
    """``<id>@v<version>`` of an engine-side name (``slots.engine_lora_name``)."""
    return engine_name.rpartition(".")[0]
