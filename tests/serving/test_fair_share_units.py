"""Virtual token counters, the gateway's fair wait queue and the engine's usage accounting."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.fair_share import (
    EngineFairShare,
    ask_stream_usage,
    usage_of_body,
    usage_of_chunk,
)
from app.errors import Overloaded
from app.gateway.fairness import FairQueue
from app.vtc import BACKGROUND_WEIGHT, VirtualTokenCounters, weight_of
from tests.helpers.aio import asynctest


def test_a_tenants_own_requests_keep_their_order_and_a_newcomer_is_lifted_to_the_virtual_time():
    vtc = VirtualTokenCounters()
    flood = [vtc.admit("flood", 1.0, 500) for _ in range(4)]
    assert [t.tag for t in flood] == [0, 500, 1000, 1500]
    vtc.finish(flood[0], 500)
    polite = vtc.admit("polite", 1.0, 10)
    # lifted to the oldest flood request still active: ahead of the flood's queued ones
    assert polite.tag == flood[1].tag == vtc.virtual_time
    assert polite.tag < flood[2].tag


def test_idle_tenants_bank_no_credit():
    vtc = VirtualTokenCounters()
    for _ in range(3):
        vtc.finish(vtc.admit("busy", 1.0, 1000), 1000)
    late = vtc.admit("late", 1.0, 10)  # nothing active: everyone starts level with the leader
    assert late.tag == 3000
    assert vtc.admit("busy", 1.0, 10).tag == 3000


def test_weights_scale_the_share_and_served_tokens_correct_the_estimate():
    vtc = VirtualTokenCounters()
    heavy, light = vtc.admit("w2", 2.0, 1000), vtc.admit("w1", 1.0, 1000)
    assert vtc.counters["w2"] == 500 and vtc.counters["w1"] == 1000
    vtc.finish(heavy, served_tokens=200)  # stopped early: charged what it was served
    assert vtc.counters["w2"] == 100
    vtc.finish(light)  # no usage known: the estimate stays
    assert vtc.counters["w1"] == 1000
    vtc.finish(light, 0)  # idempotent
    assert vtc.counters["w1"] == 1000
    assert weight_of(0) == BACKGROUND_WEIGHT and weight_of(3) == 3.0
    with pytest.raises(ValueError):
        vtc.admit("x", 0, 1)


def test_the_virtual_time_never_decreases_and_tags_are_never_below_it(seed):
    import random

    rng = random.Random(seed)
    vtc = VirtualTokenCounters()
    active, last_v = [], 0.0
    for _ in range(2000):
        if active and rng.random() < 0.5:
            vtc.finish(active.pop(rng.randrange(len(active))), rng.randrange(0, 600))
        else:
            t = vtc.admit(rng.choice("abcde"), rng.choice([0.25, 1.0, 3.0]), rng.randrange(1, 600))
            assert t.tag >= last_v
            active.append(t)
        assert vtc.virtual_time >= last_v
        last_v = vtc.virtual_time


@asynctest
async def test_fair_queue_hands_freed_slots_to_the_lowest_tag_not_the_first_arrival():
    q = FairQueue(slots=1, max_waiting=8, wait_s=5)
    order: list[str] = []
    gate = asyncio.Event()

    async def request(tenant: str, cost: int) -> None:
        async with q.slot(tenant, 1.0, cost):
            order.append(tenant)
            await gate.wait()

    holder = asyncio.create_task(request("flood", 500))
    await asyncio.sleep(0)
    flood = [asyncio.create_task(request("flood", 500)) for _ in range(3)]
    await asyncio.sleep(0)
    polite = asyncio.create_task(request("polite", 10))
    await asyncio.sleep(0)
    assert q.in_use == 1 and q.waiting == 4
    gate.set()
    await asyncio.gather(holder, *flood, polite)
    assert order == ["flood", "polite", "flood", "flood", "flood"]
    assert q.in_use == 0


@asynctest
async def test_fair_queue_is_bounded_in_length_and_in_time():
    q = FairQueue(slots=1, max_waiting=1, wait_s=0.2)
    async with q.slot("a", 1.0, 1):
        waiter = asyncio.create_task(q.slot("b", 1.0, 1).__aenter__())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            async with q.slot("c", 1.0, 1):
                pass
        assert full.value.http_status == 503 and full.value.retry_after_s >= 1
        with pytest.raises(Overloaded, match="no slot freed"):
            await waiter
    assert q.in_use == 0 and q.waiting == 0
    async with q.slot("d", 1.0, 1):  # free again
        assert q.in_use == 1


@asynctest
async def test_a_waiter_that_goes_away_gives_its_turn_on():
    q = FairQueue(slots=1, max_waiting=4, wait_s=5)
    served: list[str] = []
    release = asyncio.Event()

    async def request(tenant: str) -> None:
        async with q.slot(tenant, 1.0, 1):
            served.append(tenant)
            await release.wait()

    holder = asyncio.create_task(request("a"))
    await asyncio.sleep(0)
    gone = asyncio.create_task(request("b"))
    nxt = asyncio.create_task(request("c"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, nxt), 1)
    assert served == ["a", "c"] and q.in_use == 0 and q.waiting == 0


def test_engine_tickets_and_usage():
    fair = EngineFairShare()
    assert fair.admit(None) is None and EngineFairShare.priority(None) == 0
    t = fair.admit({"tenant": "acme", "weight": 1.0, "estimated_tokens": 300})
    assert EngineFairShare.priority(t) == 0
    t2 = fair.admit({"tenant": "acme", "weight": 1.0, "estimated_tokens": 300})
    assert EngineFairShare.priority(t2) == 300
    fair.finish(t, 40)
    fair.finish(t2, None)
    assert fair.snapshot()["active"] == 0

    body, strip = ask_stream_usage({"prompt": "x", "stream": True})
    assert strip and body["stream_options"] == {"include_usage": True}
    body, strip = ask_stream_usage({"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert not strip
    usage = 'data: {"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":3,"total_tokens":9}}\n\n'
    assert usage_of_chunk(usage) == 9
    assert usage_of_chunk('data: {"id":"c","choices":[{"text":"hi"}],"usage":{"total_tokens":5}}\n\n') is None
    assert usage_of_chunk("data: [DONE]\n\n") is None
    assert usage_of_body({"usage": {"total_tokens": 12}}) == 12 and usage_of_body({}) is None


def test_a_heavy_tenant_streams_in_chunks_a_light_one_token_by_token():
    fair = EngineFairShare(backlog_tokens=2048, stream_interval=16)
    flood = [fair.admit({"tenant": "flood", "weight": 1.0, "estimated_tokens": 1000}) for _ in range(4)]
    assert [fair.stream_interval(t) for t in flood] == [None, None, 16, 16]  # backlog 1000, 2000, 3000, 4000
    polite = fair.admit({"tenant": "polite", "weight": 1.0, "estimated_tokens": 10})
    assert fair.stream_interval(polite) is None
    assert EngineFairShare().stream_interval(flood[3]) is None  # off by default
