"""Adapter stores (a local directory, S3): one layout, versioned, atomically published.

``open_store(uri)`` picks the store for a URI; ``AdapterStore`` (``base``) holds the publish /
resolve / fetch logic both share, ``local`` and ``s3`` only move bytes.
"""

from __future__ import annotations

from .base import AdapterStore


def open_store(uri: str, endpoint_url: str | None = None, **s3_options) -> AdapterStore:
    """``file:///path`` (or a plain path) → local store; ``s3://bucket/prefix`` → S3 store.

    ``s3_options``: :class:`~adapters_registry.stores.s3.S3AdapterStore` tuning (timeouts, attempts,
    part size, concurrency); ignored for local stores.
    """
    if uri.startswith("s3://"):
        from .s3 import S3AdapterStore

        return S3AdapterStore(uri, endpoint_url=endpoint_url, **s3_options)
    from .local import LocalAdapterStore

    return LocalAdapterStore(uri)
