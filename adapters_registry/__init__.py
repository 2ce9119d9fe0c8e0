"""loraplex adapter registry: versioned stores (local directory, S3), validation, disk cache, engine slots.

- ``store.open_store(uri)`` → :class:`store.AdapterStore` (publish / get / list / delete / download)
- ``validation`` and ``normalise``: checks against :class:`manifest.BaseModelInfo`, 3-D → 2-D experts
- ``cache.AdapterCache``: content-addressed, byte-bounded LRU of verified local folders
- ``slots.AdapterSlots``: the single table of adapters registered with a replica's engine
- ``errors``: typed errors carrying ``http_status``
"""
