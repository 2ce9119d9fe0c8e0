"""Typed errors of the adapter registry.

Every error carries ``http_status`` (what the gateway answers) and a message that says what is
wrong and what to do about it; ``retry_after_s`` is set where retrying later can succeed (the
gateway turns it into a ``Retry-After`` header).
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry error."""

    http_status: int = 500
    retry_after_s: float | None = None

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def to_dict(self) -> dict:
        """JSON body for an HTTP error answer."""
        body = {"error": type(self).__name__, "message": self.message, "status": self.http_status}
        if self.retry_after_s is not None:
            body["retry_after_s"] = self.retry_after_s
        return body


class AdapterNotFound(RegistryError):
    """No such adapter (or version) in the store."""

    http_status = 404


class AdapterInvalid(RegistryError):
    """The adapter fails validation (format, shapes, rank, values, size) or is corrupt in the store."""

    http_status = 422


class AdapterConflict(RegistryError):
    """A concurrent change won (e.g. two publishes raced for the same version)."""

    http_status = 409


class StoreUnavailable(RegistryError):
    """The adapter store is down, slow or refuses access; retry later."""

    http_status = 503
    retry_after_s = 2.0


class CacheFull(RegistryError):
    """The local disk cache cannot hold the adapter (bound reached by pinned entries, or disk full)."""

    http_status = 507


class CacheUnwritable(RegistryError):
    """The local disk cache cannot be written (read-only file system, permissions)."""

    http_status = 507


class SlotsExhausted(RegistryError):
    """Every engine adapter slot is in use by running requests; retry shortly."""

    http_status = 503
    retry_after_s = 1.0


class SlotsTooSmall(RegistryError):
    """The adapter alone is larger than the replica's byte budget for registered adapters."""

    http_status = 507


class AdapterLoadFailed(RegistryError):
    """The engine refused or failed to register the adapter's files."""

    http_status = 503
    retry_after_s = 1.0
