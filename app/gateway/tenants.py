"""Tenants: hashed API keys → tenant, their adapter grants, budgets and priority.

The tenants file is YAML (in production mounted from a Kubernetes Secret). ``TenantDirectory``
re-reads it when its modification time changes, so keys can be added without a restart; a file
that fails to parse keeps the last good table (and logs why). Off the request path: inside an
event loop a watcher task checks the file every ``watch_interval_s`` in a worker thread, and a
request whose key is unknown checks it once more at once (so a key just added works at its
first request, and a removed key stops working within the interval). Outside an event loop
(tools, tests) every authentication checks the file, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator

from app.errors import Unauthorized

# A child of "ray.serve": inside a replica its records reach the replica's log file (Serve's handlers).
logger = logging.getLogger("ray.serve.loraplex.tenants")
KEY_PREFIX = "lpx-"


def hash_key(api_key: str) -> str:
    """sha256 hex digest of an API key (the only form stored)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    """A fresh random API key (shown once, stored hashed)."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


class Tenant(BaseModel):
    """One tenant of the platform."""

    name: str = Field(description="Tenant name; adapters' owner_tenant refers to it.", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    key_sha256: list[str] = Field(default_factory=list, description="sha256 hex digests of the tenant's API keys.")
    adapters: list[str] = Field(default_factory=list, description="Adapters granted beyond those the tenant owns.")
    operator: bool = Field(False, description="May use the admin API and every adapter.")
    priority: int = Field(1, ge=0, le=10, description="Fair-share weight under contention: a tenant's share of a saturated "
                          "engine is proportional to it (0 counts as a quarter; see app.vtc).")
    max_concurrency: int = Field(16, ge=1, description="Requests in flight at once before 429.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Token budget per minute (prompt + completion); None: unlimited.")

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for h in v:
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError("key_sha256 entries must be lowercase sha256 hex digests")
        return v

    def may_use(self, adapter_id: str, owner_tenant: str) -> bool:
        """Whether this tenant may call the adapter."""
        return self.operator or owner_tenant == self.name or adapter_id in self.adapters


class TenantsFile(BaseModel):
    """The tenants YAML document."""

    tenants: list[Tenant] = Field(default_factory=list, description="All tenants.")
    fair_share: bool = Field(True, description="Serve tenants in fair-share order (VTC) when the engines or a gateway "
                             "are saturated; false: first come, first served. Applies without restart.")

    @classmethod
    def read(cls, path: Path) -> "TenantsFile":
        return cls.parse(path.read_text() if path.exists() else "")

    @classmethod
    def parse(cls, text: str) -> "TenantsFile":
        """The table a tenants file's text holds (empty text: no tenants)."""
        return cls.model_validate(yaml.safe_load(text) or {})

    def write(self, path: Path) -> None:
        """Atomic write (temp + rename), mode 0600: the file holds key hashes."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def add_key(self, name: str, **fields) -> str:
        """Adds a key to tenant ``name`` (created if new); returns the new plaintext key."""
        key = new_api_key()
        for t in self.tenants:
            if t.name == name:
                t.key_sha256.append(hash_key(key))
                return key
        self.tenants.append(Tenant(name=name, key_sha256=[hash_key(key)], **fields))
        return key


class TenantDirectory:
    """Authenticates API keys against the tenants file, reloading it when it changes."""

    def __init__(self, path: Path, watch_interval_s: float = 0.5):
        self.path = path
        self.watch_interval_s = watch_interval_s
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the table loaded
        self._loaded = False
        self._by_hash: dict[str, Tenant] = {}
        self.fair_share = True
        self._watcher: asyncio.Task | None = None
        self.reload_if_changed()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload_if_changed(self) -> None:
        """Loads the file if it changed since the table in use was read. Kept instead (and looked
        at again next time): a file that does not validate; an empty file once a table is loaded
        (a writer between truncating and writing it: ``tenants: []`` removes every tenant); a
        file that changed while it was read."""
        stamp = self._stat()
        if stamp == self._stamp and self._loaded:
            return
        try:
            text = self.path.read_text() if stamp is not None else ""
            if self._loaded and stamp is not None and not text.strip():
                logger.warning("tenants file %s is empty: the last table stays (being written?)", self.path)
                return
            doc = TenantsFile.parse(text)
        except Exception as exc:  # keep the last good table
            logger.error("tenants file %s not reloaded: %s", self.path, exc)
            return
        if self._stat() != stamp:  # rewritten meanwhile: read again at the next look
            return
        self._by_hash = {h: t for t in doc.tenants for h in t.key_sha256}
        self.fair_share = doc.fair_share
        self._stamp, self._loaded = stamp, True

    def _watching(self) -> bool:
        """Whether the watcher task runs (started here inside an event loop)."""
        if self._watcher is not None and not self._watcher.done():
            return True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._watcher = asyncio.ensure_future(self._watch())
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                await asyncio.to_thread(self.reload_if_changed)
            except Exception:  # noqa: BLE001 - the watcher keeps watching
                logger.exception("tenants file %s: check failed", self.path)

    def close(self) -> None:
        """Stops the watcher (if any)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def authenticate(self, authorization: str | None) -> Tenant:
        """``Authorization: Bearer <key>`` → Tenant, or Unauthorized (401)."""
        if not self._watching():
            self.reload_if_changed()
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        digest = hash_key(authorization[7:].strip())
        tenant = self._by_hash.get(digest)
        if tenant is None:  # maybe a key added since the watcher's last look: one stat, rare
            self.reload_if_changed()
            tenant = self._by_hash.get(digest)
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant