"""Shared fixtures: the embedded default built once, one real serving stack per session, and a
replayable seed per test."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from tests.helpers.triton_interpret import import_triton_for_the_session

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ENGINE_REPLICAS = 2  # two engine replicas: routing and residency are exercised as in production
MAX_MODEL_LEN = 2048  # the tiny model's whole context: streams long enough to act on mid-stream
import_triton_for_the_session()  # before any test module imports vLLM (which imports triton)


@pytest.fixture
def seed(request) -> int:
    """A seed derived from the test's node id: the same test draws the same inputs on every run,
    and a failing test's report names it (section ``seed``)."""
    value = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(scope="session")
def vllm_gpu_stack() -> None:
    """On a CUDA machine: fails the GPU tests when vLLM is missing or another version."""
    from tests.helpers.vllm_gpu import gpu_stack_problem

    problem = gpu_stack_problem()
    if problem is not None:
        pytest.fail(problem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"inputs drawn with seed={value} (from the node id)"))


@pytest.fixture(scope="session")
def loraplex_home(tmp_path_factory) -> Path:
    """A data dir holding the embedded default (`loraplex init`)."""
    from app.embedded.setup import init

    home = tmp_path_factory.mktemp("loraplex-home")
    init(home, progress=False)
    return home


@pytest.fixture(scope="session")
def embedded_model_dir(loraplex_home) -> Path:
    from app.embedded.setup import model_dir

    return model_dir(loraplex_home)


@pytest.fixture(scope="session")
def demo_adapter_sources(tmp_path_factory, embedded_model_dir) -> dict[str, Path]:
    """The demo adapters as PEFT wrote them (rebuilt from their seeds: same bytes as `init`'s)."""
    from app.embedded.adapters import build_peft_adapter
    from app.embedded.setup import DEMO_ADAPTERS

    root = tmp_path_factory.mktemp("demo-adapters")
    return {
        s.adapter_id: build_peft_adapter(embedded_model_dir, root / s.adapter_id, s.kind, s.rank, s.seed)
        for s in DEMO_ADAPTERS
    }


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto) on 127.0.0.1 for the whole session, with test credentials."""
    from tests.helpers.s3 import MotoS3

    with MotoS3() as s3:
        s3.make_bucket("loraplex")
        yield s3


@pytest.fixture(scope="session")
def s3_store_uri(s3_server, demo_adapter_sources, embedded_model_dir) -> str:
    """``s3://loraplex/adapters`` holding the demo adapters, published from their PEFT sources."""
    from adapters_registry.manifest import BaseModelInfo
    from adapters_registry.stores import open_store
    from app.embedded.setup import DEMO_ADAPTERS

    uri = "s3://loraplex/adapters"
    store = open_store(uri, s3_server.endpoint)
    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    for spec in DEMO_ADAPTERS:
        store.publish(demo_adapter_sources[spec.adapter_id], spec.adapter_id, spec.tenant, base)
    return uri


@pytest.fixture(scope="session")
def s3_faults(s3_server):
    """The session stack's way to S3: a proxy that passes everything until a test injects a fault
    (``tests.helpers.s3_faults``)."""
    from tests.helpers.s3_faults import S3FaultProxy

    with S3FaultProxy(s3_server.port) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def serve_stack(loraplex_home, tmp_path_factory, s3_server, s3_store_uri, s3_faults):
    """The real stack (`loraplex serve`: Ray Serve + vLLM-CPU, the split topology: a gateway and
    two engine replicas, on a CUDA machine both on its GPU) on a free loopback port, adapters in
    S3 (the stack reaches it through ``s3_faults``; tests publish directly)."""
    from tests.helpers.s3 import S3_TEST_ENV
    from tests.helpers.stack import device_args, start_stack, stop_stack

    on_device = device_args(ENGINE_REPLICAS)
    stack = start_stack(
        loraplex_home,
        tmp_path_factory.mktemp("stack"),
        args_update={
            "topology": "split",  # engine replicas routed by adapter (the main job is one colocated replica)
            "store_uri": s3_store_uri,
            "s3_endpoint_url": s3_faults.endpoint,
            "engine_deployment": {"num_replicas": ENGINE_REPLICAS, **on_device.get("engine_deployment", {})},
            "engine": {"max_model_len": MAX_MODEL_LEN, **on_device.get("engine", {})},
        },
        extra_env=S3_TEST_ENV,
    )
    stack.store_uri = s3_store_uri
    stack.s3_endpoint = s3_server.endpoint
    stack.s3_faults = s3_faults
    yield stack
    stop_stack(stack)
