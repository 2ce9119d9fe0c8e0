"""The change-marker contract every adapter store keeps (``AdapterStore.change_marker``)."""

from __future__ import annotations


def assert_marker_moves_on_every_change(store, src_dir, base) -> None:
    """No marker before the first change; a new token after each publish and each delete, the
    same token between them; the marker is never listed as an adapter."""
    assert store.change_marker() is None
    store.publish(src_dir, "marker-a", "acme", base)
    first = store.change_marker()
    assert first and store.change_marker() == first  # reading leaves it alone
    store.publish(src_dir, "marker-a", "acme", base)
    second = store.change_marker()
    assert second not in (None, first)
    assert [m.lora_name for m in store.list()] == ["marker-a@v2"]
    store.delete("marker-a")
    assert store.change_marker() not in (None, first, second)
    assert store.list() == []
