"""Completions through a stack, as token ids: streamed (SSE) or not, with what answered them."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


def signal_each(pids, sig: int) -> None:
    """``sig`` to every pid that still exists (one gone since it was listed is skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Completion:
    status: int
    tokens: list[int] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    replica: str | None = None
    model: str | None = None  # the engine-side name: ``<id>@v<n>.<digest prefix>``
    error: dict | None = None  # an error body (the answer's, or an SSE error event's)
    done: bool = False  # the stream ended with ``[DONE]``
    retry_after: str | None = None


def _token_ids(logprobs: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]]


def complete(stack, headers: dict, body: dict, timeout: float = 300,
             on_token: Callable[[Completion], None] | None = None) -> Completion:
    """A completion (``body`` as the client sends it) with token ids: ``return_tokens_as_token_ids``
    and ``logprobs`` are added (``logprobs`` defaults to 1). ``on_token`` is called with the
    completion so far at each event of a stream that carries tokens."""
    body = {"logprobs": 1, **body, "return_tokens_as_token_ids": True}
    url = stack.base_url + "/v1/completions"
    if not body.get("stream"):
        r = httpx.post(url, headers=headers, json=body, timeout=timeout)
        out = Completion(r.status_code, replica=r.headers.get("x-loraplex-replica"),
                         retry_after=r.headers.get("retry-after"))
        data = r.json()
        if r.status_code != 200:
            out.error = data
            return out
        choice = data["choices"][0]
        out.tokens, out.top_logprobs = _token_ids(choice["logprobs"]), choice["logprobs"]["top_logprobs"]
        out.model, out.done = data["model"], True
        return out
    with httpx.stream("POST", url, headers=headers, json=body, timeout=timeout) as s:
        out = Completion(s.status_code, replica=s.headers.get("x-loraplex-replica"),
                         retry_after=s.headers.get("retry-after"))
        if s.status_code != 200:
            s.read()
            out.error = s.json()
            return out
        for line in s.iter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event
                    continue
                out.model = event.get("model", out.model)
                for choice in event.get("choices", []):
                    if choice.get("logprobs"):
                        out.tokens += _token_ids(choice["logprobs"])
                        out.top_logprobs += choice["logprobs"]["top_logprobs"]
                        if on_token is not None:
                            on_token(out)
    return out


class StreamInChild:
    """``complete()`` of a streamed request in a spawned process, so the test's own threads keep
    running while it streams. A thread of the test process reading a fast SSE stream wants the GIL
    back at every event; on a busy 2-core host each hand-back also waits for the scheduler, and the
    test's main thread (publishing, polling Ray) then gets almost no time until the stream ends.

    ``first_token`` is set at the stream's first token (``replica`` then names the engine replica
    that answers), ``finished`` when the response is read to its end (before the result travels
    back); ``result()`` is the ``Completion``.

    ``freeze``: pids the child stops (SIGSTOP) at the first token, before ``first_token`` is set,
    so a step the test takes "mid-stream" happens while the stream cannot end, however long the
    host keeps the test waiting; ``thaw()`` continues them (call it in a ``finally``)."""

    def __init__(self, stack, headers: dict, body: dict, timeout: float = 300, freeze: tuple[int, ...] = ()) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.first_token, self.finished = ctx.Event(), ctx.Event()
        self._replica = ctx.Array("c", 256)
        self._results = ctx.SimpleQueue()
        self._timeout = timeout
        self._frozen = tuple(freeze)
        self._proc = ctx.Process(target=_stream_child, daemon=True, name="stream-in-child",
                                 args=(stack.base_url, headers, body, timeout, self.first_token, self._replica,
                                       self.finished, self._results, self._frozen))
        self._proc.start()

    @property
    def replica(self) -> str | None:
        """The answering engine replica, once ``first_token`` is set."""
        return self._replica.value.decode() or None

    def thaw(self) -> None:
        """SIGCONT to every frozen pid that still exists (idempotent)."""
        signal_each(self._frozen, signal.SIGCONT)

    def streaming(self) -> bool:
        """True while the response is still being read."""
        return not self.finished.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        """The completion, once the stream has ended (``TimeoutError`` after ``timeout`` s)."""
        limit = self._timeout + 30 if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.finished.wait(1):
            if not self._proc.is_alive():
                raise RuntimeError(f"the streaming process died (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise TimeoutError(f"the stream did not end in {limit} s")
        got = self._results.get()
        self._proc.join(30)
        if isinstance(got, BaseException):
            raise got
        return got


def _stream_child(base_url: str, headers: dict, body: dict, timeout: float, first_token, replica, finished,
                  results, freeze: tuple[int, ...]) -> None:
    from types import SimpleNamespace

    def at_token(so_far: Completion) -> None:
        if first_token.is_set():
            return
        replica.value = (so_far.replica or "").encode()[:255]
        signal_each(freeze, signal.SIGSTOP)
        first_token.set()

    try:
        got = complete(SimpleNamespace(base_url=base_url), headers, body, timeout, on_token=at_token)
    except Exception as e:  # the parent raises it (as text: not every exception pickles)
        got = RuntimeError(f"the stream failed: {e!r}")
    finished.set()
    results.put(got)
