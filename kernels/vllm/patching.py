"""The one way loraplex changes vLLM's objects: ``Patches``.

An integration collects its changes in one ``Patches``: each ``replace`` / ``wrap`` records the
attribute's previous value (the raw class-dict entry, so class and static methods come back as
they were, and an inherited attribute is deleted again rather than shadowed), ``undo`` restores
them in reverse order. ``wrap`` hands the wrapper the function it wraps — vLLM's, or an earlier
wrapper's — so two wrappers of one method chain explicitly, in the order they were applied.
``expect`` refuses to patch a name that no longer holds what the integration was written for
(a vLLM module that imported a function by name and so holds its own reference).

Per-object state of loraplex's (per MoE layer, per LoRA context) lives in ``ObjectMap``s here,
never as attributes set on vLLM's objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kernels.vllm.versions import UnsupportedVLLMError

_MISSING = object()
V = TypeVar("V")


@dataclass
class _Change:
    owner: Any
    name: str
    previous: Any  # the raw entry of ``vars(owner)``, or _MISSING when it was inherited/absent


class Patches:
    """One integration's changes to vLLM's modules and classes (see the module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._changes: list[_Change] = []

    @property
    def active(self) -> bool:
        return bool(self._changes)

    def replace(self, owner: Any, name: str, replacement: Any, *, expect: Any = _MISSING) -> Any:
        """Sets ``owner.name`` to ``replacement``; returns the value it had (as looked up).
        With ``expect``: raises ``UnsupportedVLLMError`` unless the current value is it."""
        current = getattr(owner, name, _MISSING)
        if expect is not _MISSING and current is not expect:
            raise UnsupportedVLLMError(
                f"{self.name}: {_where(owner)}.{name} is not the object it was written for "
                "(vLLM's layout changed); the patch cannot be applied")
        self._changes.append(_Change(owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, replacement)
        return current

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """``owner.name = make(current)``: the wrapper gets what it wraps; returns the wrapper."""
        current = getattr(owner, name)
        wrapper = make(current)
        self.replace(owner, name, wrapper)
        return wrapper

    def original(self, owner: Any, name: str) -> Any:
        """``owner.name`` as it was before these patches (vLLM's own)."""
        for change in self._changes:
            if change.owner is owner and change.name == name:
                if change.previous is _MISSING:
                    return _inherited(owner, name)
                return change.previous.__get__(None, owner) if isinstance(
                    change.previous, (classmethod, staticmethod)) else change.previous
        return getattr(owner, name)

    def undo(self) -> None:
        """Restores every changed attribute, last change first."""
        while self._changes:
            change = self._changes.pop()
            if change.previous is _MISSING:
                try:
                    delattr(change.owner, change.name)
                except AttributeError:
                    pass
            else:
                setattr(change.owner, change.name, change.previous)


def _inherited(owner: Any, name: str) -> Any:
    for base in getattr(owner, "__mro__", ())[1:]:
        if name in vars(base):
            return getattr(base, name)
    return None


def _where(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


class ObjectMap(Generic[V]):
    """Values kept per object by identity, weakly: an entry goes with its object. Works for
    vLLM's dataclasses, which compare by value and so cannot key a ``WeakKeyDictionary``."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: Any, default: V | None = None) -> V | None:
        entry = self._values.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def __setitem__(self, obj: Any, value: V) -> None:
        key = id(obj)
        self._values[key] = (weakref.ref(obj, lambda _, key=key: self._values.pop(key, None)),
                             value)

    def __contains__(self, obj: Any) -> bool:
        entry = self._values.get(id(obj))
        return entry is not None and entry[0]() is obj

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()
