"""Body parsing on the gateway's request path: unpaired surrogates refused however they arrive,
a body of token ids accepted without walking its elements; the token estimate of a prompt."""

from __future__ import annotations

import json

import pytest

from app.errors import BadRequest
from app.gateway.ingress import _prompt_estimate
from app.gateway.request_limits import may_hold_surrogates, parse_object


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\\ud800b"}',  # a lone high surrogate, escaped
    b'{"prompt": ["x", "\\uDC00"]}',  # a lone low one, upper-case hex, in a list
    b'{"prompt": "a\xed\xa0\x80b"}',  # the UTF-8 bytes of one: json.loads passes them through
    b'{"\\ud801": 1}',  # in a key
])
def test_unpaired_surrogates_are_refused_naming_where(raw):
    assert may_hold_surrogates(raw)
    with pytest.raises(BadRequest, match="unpaired UTF-16 surrogate in body"):
        parse_object(raw)


def test_paired_surrogates_and_other_text_pass():
    body = parse_object('{"prompt": "\\ud83d\\ude00 한국어 é"}'.encode())
    assert body["prompt"] == "\U0001F600 한국어 é"


def test_a_body_of_token_ids_is_parsed_without_the_walk():
    raw = json.dumps({"model": "a", "prompt": list(range(1600)), "max_tokens": 8}).encode()
    assert not may_hold_surrogates(raw)
    assert parse_object(raw)["prompt"][-1] == 1599


def test_prompt_estimates():
    assert _prompt_estimate(list(range(1600))) == 1600  # token ids: one each
    assert _prompt_estimate([[1, 2, 3], [4, 5]]) == 5  # a batch of token-id prompts
    assert _prompt_estimate("x" * 400) == 100  # text: ~4 characters a token
    assert _prompt_estimate([{"role": "user", "content": "x" * 400}]) >= 100  # messages
    assert _prompt_estimate(None) == 1 and _prompt_estimate([]) == 0
