"""``scripts/gpu_checks.sh`` runs every test module with a CUDA part on the GPU host: a module
gated on CUDA but missing from its list would only ever run its CPU half."""

from __future__ import annotations

import re

from tests.helpers.paths import REPO

CUDA_GATES = re.compile(r"needs_vllm024_gpu|HAS_CUDA|cuda\.is_available\(\)|interpreter_when_no_gpu")
SCRIPT = REPO / "scripts" / "gpu_checks.sh"


def test_every_module_with_a_cuda_part_is_in_the_gpu_test_list():
    listed = set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))
    gated = {str(p.relative_to(REPO)) for folder in ("kernels", "benchmarks", "registry", "serving")
             for p in (REPO / "tests" / folder).rglob("test_*.py") if CUDA_GATES.search(p.read_text())}
    assert gated, "no module gated on CUDA found: the pattern no longer matches the suite's gates"
    assert not gated - listed, f"modules with a CUDA part missing from {SCRIPT.name}'s GPU_TESTS: {sorted(gated - listed)}"
    assert all((REPO / p).is_file() for p in listed), "GPU_TESTS names a module that does not exist"
