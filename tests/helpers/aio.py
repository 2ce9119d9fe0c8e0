"""Async tests without a pytest plugin."""

from __future__ import annotations

import asyncio
import functools


def asynctest(fn):
    """Run an ``async def`` test function with ``asyncio.run`` (no pytest plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper
