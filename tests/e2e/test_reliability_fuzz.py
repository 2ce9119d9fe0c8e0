"""API fuzzing of the gateway with schemathesis, from the OpenAPI schema the running stack serves:
for every operation, a bounded number of generated requests (valid per the schema and invalid on
purpose), sent with a tenant's key to the real stack. None may be a 5xx, and every 4xx must carry
a JSON error body whose message says what to fix. The examples are derandomized, so every CI run
sends the same requests; the counts are printed (``-s``) for the reliability table."""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = pytest.mark.e2e
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 12}  # per operation
MAX_TOKENS = 16  # generated bodies ask for at most this many tokens: the fuzz is about input, not load


def _problem(response) -> str | None:
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    if status >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without a JSON error body: {response.text[:300]}"
        if not isinstance(message, str) or len(message) < 10:
            return f"{status} with an empty error message: {response.text[:300]}"
    return None


def _bounded(case) -> None:
    """Generated completions ask for few tokens (a huge max_tokens is a 400 of its own test)."""
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > MAX_TOKENS:
                case.body[key] = MAX_TOKENS
        if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = MAX_TOKENS
        if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
            case.body["n"] = 2


def test_fuzzed_requests_get_no_5xx_and_every_4xx_says_what_to_fix(serve_stack):
    schema = schemathesis.openapi.from_url(serve_stack.base_url + "/openapi.json")
    headers = serve_stack.headers("acme")
    sent: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6, [op.label for op in operations]
    for op in operations:
        for mode, examples in EXAMPLES.items():
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                _bounded(case)
                response = case.call(base_url=serve_stack.base_url, headers=headers, timeout=120)
                sent[f"{response.status_code // 100}xx"] += 1
                sent["requests"] += 1
                if problem := _problem(response):
                    problems.append(f"{op.label} [{mode.value}] {problem}")

            try:
                run()
            except Unsatisfiable:  # nothing to generate (no parameters to break in negative mode)
                sent[f"no {mode.value} cases"] += 1
    print(f"\nschemathesis: {len(operations)} operations, {dict(sent)}")
    assert sent["requests"] >= len(operations) * 2
    assert problems == []
