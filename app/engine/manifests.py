"""Validated adapter manifests of the engine replica, kept across requests.

Every request from the gateway carries its adapter's manifest as a JSON dump (plain data across
Ray). Validating it into an ``AdapterManifest`` each time is pydantic work on the replica's event
loop for a value that changes only when a new version is published. ``ManifestCache`` validates a
dump once and hands out the same model while the same dump arrives again: the key is
``(adapter_id, version)`` and a hit also requires the whole dump to be equal (a plain dict
comparison), so a different dump under the same key (a store re-created with other content) is
validated afresh and replaces the entry. Bounded: beyond ``max_entries`` the oldest entry goes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from adapters_registry.manifest import AdapterManifest


class ManifestCache:
    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[Any, Any], tuple[dict, AdapterManifest]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, dump: dict | None) -> AdapterManifest | None:
        """The manifest of ``dump`` (None for None); raises pydantic's ValidationError if invalid."""
        if dump is None:
            return None
        key = (dump.get("adapter_id"), dump.get("version"))
        hit = self._entries.get(key)
        if hit is not None and hit[0] == dump:
            return hit[1]
        manifest = AdapterManifest.model_validate(dump)
        self._entries[key] = (dump, manifest)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return manifest
