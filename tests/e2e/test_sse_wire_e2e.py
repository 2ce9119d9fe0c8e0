"""Streams through the real gateway are valid SSE, byte for byte, for raw HTTP, the OpenAI Python
SDK and vLLM's own benchmark client (``vllm bench serve``).

The relay may write several events at once (``app.stream_coalesce``) but every event must be
vLLM's own chunk, unchanged: ``data: <JSON>\\n\\n`` lines, each JSON exactly what vLLM's pydantic
chunk model serialises it to, ``data: [DONE]`` last, the text equal to the non-streamed answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from benchmarks.loadgen.vllm_bench import VLLM_BENCH_BOOT
from tests.helpers.sse_wire import sse_events

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24
CASES = [("completion", "loraplex-base", "acme"), ("completion", "acme-support", "acme"),
         ("chat", "globex-legal", "globex"), ("chat", "loraplex-base", "globex")]


def _body(kind: str, model: str, stream: bool) -> dict:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": "tell me about the experts"}]}
    return {**body, "prompt": "the experts of the mixture said"}


def _chunk_model(kind: str):
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

        return ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    return CompletionStreamResponse


def _text(kind: str, choice: dict) -> str:
    return (choice.get("delta", {}).get("content") or "") if kind == "chat" else choice.get("text", "")


@pytest.mark.parametrize("kind,model,tenant", CASES)
def test_raw_stream_is_vllms_events_unchanged(serve_stack, kind, model, tenant):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {serve_stack.keys[tenant]}"}
    with httpx.Client(base_url=serve_stack.base_url, timeout=120) as c:
        full = c.post(path, headers=headers, json=_body(kind, model, False))
        assert full.status_code == 200, full.text
        body = {**_body(kind, model, True), "stream_options": {"include_usage": True}}
        with c.stream("POST", path, headers=headers, json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read()
    events = sse_events(raw)
    chunk_model = _chunk_model(kind)
    for line, obj in zip(raw.decode().split("\n\n"), events):
        # exactly what vLLM's serving layer writes for that chunk (it dumps with exclude_unset)
        assert line == "data: " + chunk_model.model_validate(obj).model_dump_json(exclude_unset=True)
    choices = [ch for e in events for ch in e["choices"]]
    assert "".join(_text(kind, ch) for ch in choices) == (
        full.json()["choices"][0]["message"]["content"] if kind == "chat" else full.json()["choices"][0]["text"])
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS and not events[-1]["choices"]
    assert len({e["id"] for e in events}) == 1


def test_openai_sdk_streams_parse_and_equal_the_raw_stream(serve_stack):
    sdk = openai.OpenAI(base_url=serve_stack.base_url + "/v1", api_key=serve_stack.keys["acme"], max_retries=0)
    raw = httpx.post(serve_stack.base_url + "/v1/completions", timeout=120,
                     headers={"Authorization": f"Bearer {serve_stack.keys['acme']}"},
                     json=_body("completion", "acme-support", True)).content
    want = "".join(ch["text"] for e in sse_events(raw) for ch in e["choices"])
    chunks = list(sdk.completions.create(model="acme-support", prompt="the experts of the mixture said",
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}))
    assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks if c.choices) == want
    chat = list(sdk.chat.completions.create(model="loraplex-base", max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chat[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] == "length"


def test_vllm_bench_serve_client_completes_every_stream(serve_stack, embedded_model_dir, tmp_path):
    """vLLM's client parses every stream (its own SSE splitter) with no failure, all tokens counted."""
    prompts, out_len = 12, 16
    result = tmp_path / "bench.json"
    args = ["--backend", "openai", "--base-url", serve_stack.base_url, "--endpoint", "/v1/completions",
            "--model", "loraplex-base", "--tokenizer", str(embedded_model_dir), "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", str(out_len), "--num-prompts", str(prompts),
            "--max-concurrency", "4", "--request-rate", "inf", "--seed", "0", "--temperature", "0",
            "--ignore-eos", "--lora-modules", "loraplex-base", "acme-support", "acme-experts",
            "--lora-assignment", "round-robin", "--ready-check-timeout-sec", "60", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", result.name]
    env = dict(os.environ, OPENAI_API_KEY=serve_stack.keys["acme"], HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", VLLM_BENCH_BOOT, *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(result.read_text())
    assert data["completed"] == prompts and data.get("failed", 0) == 0, data.get("errors")
    assert data["total_output_tokens"] == prompts * out_len
