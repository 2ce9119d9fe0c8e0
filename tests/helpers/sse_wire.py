"""What a valid OpenAI SSE stream is, checked on the raw bytes of a response body.

vLLM's serving layer writes each chunk as ``data: <JSON>\\n\\n`` and ends with
``data: [DONE]\\n\\n``; a relay may write several whole events at once but must neither split
nor alter one. ``sse_events`` returns the JSON payloads of a body and raises AssertionError
naming the first offence.
"""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]"


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON objects of ``body`` (a complete stream), in order; asserts the wire format."""
    text = body.decode("utf-8")  # a relay that split a UTF-8 sequence across events fails here
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-40:]!r}"
    events = text[:-2].split("\n\n")
    assert events and events[-1] == DONE, f"last event is not [DONE]: {events[-1:]!r}"
    payloads = []
    for i, event in enumerate(events[:-1]):
        assert "\n" not in event and "\r" not in event, f"event {i} spans several lines: {event[:80]!r}"
        assert event.startswith("data: "), f"event {i} is not a data line: {event[:80]!r}"
        assert event != DONE, f"[DONE] before the end (event {i} of {len(events)})"
        obj = json.loads(event[len("data: "):])
        assert isinstance(obj, dict), f"event {i} is not a JSON object"
        payloads.append(obj)
    return payloads
