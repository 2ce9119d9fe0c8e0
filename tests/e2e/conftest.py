"""Fixtures of the end-to-end reliability tests: every engine replica of the session stack."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def replica_probe(serve_stack):
    """``tests.helpers.replica_probe.ReplicaProbe`` attached to the session stack's Ray cluster."""
    from tests.helpers.replica_probe import ReplicaProbe

    with ReplicaProbe(serve_stack) as probe:
        yield probe


@pytest.fixture
def stack_invariants(serve_stack, replica_probe, s3_server):
    """``check()`` → the problems (``tests.helpers.invariants``) of the session stack, once settled."""
    from tests.conftest import ENGINE_REPLICAS
    from tests.helpers.invariants import settled

    def check(timeout_s: float = 60) -> list[str]:
        return settled(serve_stack, replica_probe, timeout_s=timeout_s, s3_client=s3_server.client(),
                       replicas=ENGINE_REPLICAS)

    return check
