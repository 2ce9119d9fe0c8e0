"""Time to first token and inter-token latency of one request, from the progress of vLLM's outputs.

vLLM stamps each request with the wall time it was added and the engine-core (monotonic) times
of its first and latest token; ``app.engine.vllm_serving.output_progress`` reads them off each
output the engine yields. ``TokenClock`` turns a request's sequence of progress reports into:

- TTFT: wall time at which the replica processed the first token minus the request's arrival at
  the replica (both this process's wall clock), reported once;
- ITL samples: for each report that adds ``k`` generated tokens, ``k`` samples of the interval
  since the previous report's latest token divided by ``k`` (engine-core clock). Over a request
  the samples number ``generated - 1`` and sum to ``last_token_ts - first_token_ts``: per token
  when outputs stream one token each, the request's mean interval when one output carries them all;
- token totals as the usage counts them (prompt token ids, generated token ids of every choice).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutputProgress:
    """What one engine output tells about its request (engine-core times are monotonic seconds)."""

    prompt_tokens: int | None  # prompt token ids on this output (None: not carried)
    output_tokens: int  # generated token ids this output carries, over all choices
    cumulative: bool  # output_tokens counts every token so far (else only new ones)
    generated: int  # the engine's count of tokens generated so far (0: none yet)
    first_token_wall: float | None  # wall time the replica processed the first token (None: not yet)
    first_token_ts: float  # engine-core time of the first token
    last_token_ts: float  # engine-core time of the latest token
    arrival_wall: float | None = None  # wall time vLLM's engine took the request (None: not known)
    queued_ts: float = 0.0  # engine-core time it entered the scheduler's queue (0: not known)
    scheduled_ts: float = 0.0  # engine-core time it was first scheduled (0: not known)


@dataclass(frozen=True, slots=True)
class Step:
    """What one progress report adds: TTFT (first time only) and ``itl_count`` samples of ``itl``."""

    ttft: float | None
    itl: float
    itl_count: int


class TokenClock:
    """One request's token timing; ``update`` with every output, in order."""

    def __init__(self, started_wall: float) -> None:
        self.started_wall = started_wall
        self.to_engine_s: float | None = None  # set with the first token, as are the next two
        self.engine_queue_s: float | None = None
        self.prefill_s: float | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._first_seen = False
        self._counted = 0  # generated tokens accounted for so far
        self._last_ts = 0.0

    def update(self, p: OutputProgress) -> Step:
        if p.prompt_tokens is not None:
            self.prompt_tokens = p.prompt_tokens
        self.output_tokens = p.output_tokens if p.cumulative else self.output_tokens + p.output_tokens
        if p.generated <= 0 or (not self._first_seen and p.first_token_wall is None):
            return Step(None, 0.0, 0)
        ttft = None
        if not self._first_seen:
            self._first_seen = True
            ttft = max(0.0, p.first_token_wall - self.started_wall)
            self._counted, self._last_ts = 1, p.first_token_ts
            self._split_first_token(p)
        new = p.generated - self._counted
        if new <= 0:
            return Step(ttft, 0.0, 0)
        itl = max(0.0, p.last_token_ts - self._last_ts) / new
        self._counted, self._last_ts = p.generated, p.last_token_ts
        return Step(ttft, itl, new)

    def _split_first_token(self, p: OutputProgress) -> None:
        """TTFT's parts where vLLM reported them: to the engine, queued, prefill."""
        if p.arrival_wall:
            self.to_engine_s = max(0.0, p.arrival_wall - self.started_wall)
        if p.scheduled_ts:
            if p.queued_ts:
                self.engine_queue_s = max(0.0, p.scheduled_ts - p.queued_ts)
            self.prefill_s = max(0.0, p.first_token_ts - p.scheduled_ts)
