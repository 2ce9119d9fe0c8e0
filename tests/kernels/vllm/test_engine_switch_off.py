"""The engine deployment with loraplex's MoE-LoRA switch off, in-process (no Ray).

vLLM-CPU then has no expert LoRA: attention adapters and the base model keep working, and an
adapter with expert LoRA is refused with 422 and the reason, never served without its experts.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import hf_reference as ref
from tests.helpers.vllm_gpu import vllm_cpu_only

pytestmark = [pytest.mark.e2e, vllm_cpu_only]


@pytest.fixture(scope="module")
def engine_off(loraplex_home, tmp_path_factory):
    from app.engine.server import EngineServer

    mp = pytest.MonkeyPatch()
    mp.setenv("LORAPLEX_MOE_LORA", "0")  # EngineServer sets it too; this restores it afterwards
    config = {
        "store_uri": (loraplex_home / "store").as_uri(),
        "cache_dir": str(tmp_path_factory.mktemp("cache-off")),
        "engine": {"model": str(loraplex_home / "models" / "tiny-qwen3-moe"), "dtype": "float32",
                   "max_model_len": 512, "max_num_seqs": 8, "max_loras": 2, "max_cpu_loras": 2,
                   "moe_lora_plugin": False, "cpu_kvcache_space_gib": 1},
    }
    loop = asyncio.new_event_loop()
    server = EngineServer.__new__(EngineServer)
    loop.run_until_complete(server.__init__(config))
    yield server, loop

    async def shutdown():  # as Serve shuts a replica down: its destructor, on the replica's loop
        server.__del__()

    loop.run_until_complete(shutdown())
    # vLLM's sockets are closed now: its zmq context can be collected without blocking
    assert server.serving.engine.engine_core.resources.output_socket.closed
    loop.close()
    mp.undo()


def manifest(loraplex_home, adapter_id):
    from adapters_registry.stores import open_store

    return open_store((loraplex_home / "store").as_uri()).get(adapter_id).model_dump(mode="json")


def test_expert_adapter_is_refused_with_the_reason(engine_off, loraplex_home):
    server, loop = engine_off
    out = loop.run_until_complete(server.generate(
        "completion", {"prompt": "hello", "max_tokens": 4, "temperature": 0}, manifest(loraplex_home, "acme-experts")))
    assert out["status"] == 422
    message = out["body"]["error"]["message"]
    assert "acme-experts" in message and "expert LoRA" in message and "LORAPLEX_MOE_LORA=0" in message
    assert all(row["adapter_id"] != "acme-experts" for row in server.slots.snapshot())


def test_attention_adapter_and_base_still_match_the_reference(engine_off, loraplex_home, embedded_model_dir, demo_adapter_sources):
    server, loop = engine_off
    prompt = "the expert said"
    ids = ref.prompt_ids(embedded_model_dir, prompt)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
    outputs = []
    for adapter_id, source in (("acme-support", demo_adapter_sources["acme-support"]), (None, None)):
        m = manifest(loraplex_home, adapter_id) if adapter_id else None
        out = loop.run_until_complete(server.generate("completion", body, m))
        assert out["status"] == 200, out
        served = [int(t.split(":")[1]) for t in out["body"]["choices"][0]["logprobs"]["tokens"]]
        assert served == ref.greedy(embedded_model_dir, source, ids, 8)
        outputs.append(served)
    assert outputs[0] != outputs[1]  # the attention adapter shows in the output
