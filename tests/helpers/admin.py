"""The operator API of a stack, as the tests drive it."""

from __future__ import annotations

from pathlib import Path

import httpx


def push(stack, adapter_id: str, tenant: str, folder: Path) -> dict:
    """``POST /admin/adapters`` (a new version); the manifest published."""
    files = [("files", (n, (folder / n).read_bytes(), "application/octet-stream"))
             for n in ("adapter_config.json", "adapter_model.safetensors")]
    r = httpx.post(stack.base_url + "/admin/adapters", data={"adapter_id": adapter_id, "tenant": tenant},
                   files=files, headers=stack.headers("operator"), timeout=120)
    assert r.status_code == 201, r.text
    return r.json()


def delete(stack, adapter_id: str) -> httpx.Response:
    return httpx.delete(f"{stack.base_url}/admin/adapters/{adapter_id}", headers=stack.headers("operator"), timeout=60)
