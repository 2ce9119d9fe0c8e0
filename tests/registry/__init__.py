"""Adapter registry: stores, validation, layouts, disk cache, slots."""
