"""The colocated topology end to end: one Serve deployment whose replica runs the gateway and the
engine in one process (``topology: colocated``), through ``loraplex serve`` and the OpenAI SDK.
Outputs equal transformers + PEFT; tenancy and errors are the gateway's; a stream the client
abandons releases the adapter's pin and vLLM's request as in the split topology."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest

from tests.conftest import MAX_MODEL_LEN
from tests.helpers import hf_reference as ref

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12
PROMPT = "please route 42 requests to the expert"


@pytest.fixture(scope="module")
def colocated_stack(loraplex_home, tmp_path_factory):
    """A stack of its own (own LORAPLEX_HOME and local adapter store), colocated topology."""
    from app.embedded.setup import init
    from tests.helpers.stack import start_stack, stop_stack

    home = tmp_path_factory.mktemp("colocated-home")
    shutil.copytree(loraplex_home / "models", home / "models")
    init(home, progress=False)
    stack = start_stack(home, tmp_path_factory.mktemp("colocated-stack"),
                        args_update={"topology": "colocated", "engine": {"max_model_len": MAX_MODEL_LEN}})
    yield stack
    stop_stack(stack)


def _client(stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys[tenant], max_retries=0)


def _store_dir(home, adapter_id: str):
    """The adapter's PEFT folder in the stack's local store (its latest version)."""
    from adapters_registry.stores import open_store

    version = open_store((home / "store").resolve().as_uri()).get(adapter_id).version
    return home / "store" / adapter_id / str(version)


def _chat_ids(stack, tenant: str, model: str) -> list[int]:
    out = _client(stack, tenant).chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True},
    )
    return [int(t.token.split(":")[1]) for t in out.choices[0].logprobs.content]


def _residency(stack) -> dict:
    r = httpx.get(stack.base_url + "/admin/residency", headers=stack.headers("operator"), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_deployment_serves_base_and_adapters_equal_to_peft(colocated_stack, embedded_model_dir):
    stack = colocated_stack
    ids = ref.chat_prompt_ids(embedded_model_dir, PROMPT)
    assert _chat_ids(stack, "acme", "loraplex-base") == ref.greedy(embedded_model_dir, None, ids, MAX_TOKENS)
    expected = ref.greedy(embedded_model_dir, _store_dir(stack.home, "acme-support"), ids, MAX_TOKENS)
    assert _chat_ids(stack, "acme", "acme-support") == expected
    # one replica answers as gateway and as engine: no second deployment behind it
    r = httpx.post(stack.base_url + "/v1/completions", headers=stack.headers("acme"), timeout=60,
                   json={"model": "acme-support", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-loraplex-gateway"] == r.headers["x-loraplex-replica"]
    assert any(row["adapter_id"] == "acme-support" and row["loaded"] for row in _residency(stack)["slots"])


def test_a_stream_equals_the_whole_answer(colocated_stack):
    client = _client(colocated_stack, "globex")
    body = {"model": "globex-legal", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.completions.create(**body).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == whole


def test_tenancy_errors_are_the_gateways(colocated_stack):
    stack = colocated_stack
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="not-a-key", max_retries=0).completions.create(
            model="loraplex-base", prompt="x", max_tokens=1)
    for adapter in ("no-such-adapter", "globex-legal"):  # unknown, and another tenant's: the same 404
        with pytest.raises(openai.NotFoundError) as err:
            _client(stack, "acme").completions.create(model=adapter, prompt="x", max_tokens=1)
        assert adapter in str(err.value)
    r = httpx.post(stack.base_url + "/v1/completions", headers=stack.headers("acme"), timeout=30,
                   content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.text


def test_an_abandoned_stream_releases_its_pin_and_its_engine_request(colocated_stack):
    stack = colocated_stack
    body = {"model": "acme-support", "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", stack.base_url + "/v1/completions", headers=stack.headers("acme"), json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        during = _residency(stack)
        assert "acme-support" in [row["adapter_id"] for row in during["slots"] if row["active_requests"]]
    deadline = time.monotonic() + 30
    while True:
        after = _residency(stack)
        if not any(row["active_requests"] for row in after["slots"]) and after["engine_requests"] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    # and the replica keeps serving
    assert _client(stack, "acme").completions.create(model="acme-support", prompt="x", max_tokens=2).choices


def test_the_replica_exports_gateway_and_engine_metrics(colocated_stack):
    """Both recorders live in one process: each request shows in the gateway's and the engine's series."""
    from tests.helpers.metrics_scrape import scrape_until

    stack = colocated_stack
    assert _client(stack, "acme").completions.create(model="loraplex-base", prompt="x", max_tokens=2).choices

    def both(s) -> bool:
        return (s.total("ray_loraplex_gateway_queue_seconds_count", tenant="acme") > 0
                and s.total("ray_loraplex_engine_requests_total", tenant="acme") > 0)

    assert both(scrape_until(stack, both))
