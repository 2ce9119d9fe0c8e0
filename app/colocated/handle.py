"""An engine object in this process, called through the part of Serve's ``DeploymentHandle`` API the
gateway uses: ``handle.options(...).method.remote(*args)``.

``.remote`` of a coroutine method returns its coroutine (awaited by the caller, as a
``DeploymentResponse`` is); of a plain method, an already-finished awaitable; of an async
generator method, a ``LocalStream`` (``__anext__``, ``cancel()``, as Serve's
``DeploymentResponseGenerator``). ``options`` is accepted and ignored: there is one replica, this
one, so routing hints (``multiplexed_model_id``) and ``stream=True`` change nothing. Arguments are
passed by reference, not copied: callers hand over what they no longer change.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any


class LocalStream:
    """An async generator of the engine as Serve's response generator. ``cancel()`` closes it
    (its ``finally`` blocks run: vLLM aborts the request, the adapter is unpinned) without the
    caller awaiting; ``aclose()`` does the same and waits. Either may be called again."""

    def __init__(self, agen: AsyncGenerator[Any, None]) -> None:
        self._agen = agen
        self._closing: asyncio.Future | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:
        """Closes the generator if no task is inside it now; if one is (a pump reading it), that
        task's own cancellation ends the generator there, as closing the pump always does."""
        if self._closing is None and not self._agen.ag_running:
            self._closing = asyncio.ensure_future(self._agen.aclose())

    async def aclose(self) -> None:
        self.cancel()
        if self._closing is not None:
            await self._closing


async def _finished(value: Any) -> Any:
    return value


class _Method:
    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Awaitable[Any] | LocalStream:
        if inspect.isasyncgenfunction(self._fn):
            return LocalStream(self._fn(*args, **kwargs))
        result = self._fn(*args, **kwargs)
        return result if inspect.isawaitable(result) else _finished(result)


class LocalHandle:
    """``target``'s public methods as handle methods; a missing one raises ``AttributeError`` (as
    ``getattr(handle, name, None)`` expects)."""

    def __init__(self, target: object) -> None:
        self._target = target

    def options(self, **_: Any) -> LocalHandle:
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self._target, name))
