"""The package map of docs/architecture.md holds in the code: no import cycles among product
modules, no upward imports (the registry and the kernels never import the app), compute modules
import no vLLM (only ``kernels.vllm`` touches it), and every vLLM version check reads one table."""

from __future__ import annotations

import re

from tests.helpers.imports import cycles, import_graph, product_modules

GRAPH = import_graph()


def top(module: str) -> str:
    return module.split(".")[0]


def test_no_import_cycles_even_through_imports_inside_functions():
    assert cycles(GRAPH) == []


def test_the_registry_and_the_kernels_never_import_the_app():
    upward = [(e.source, e.target) for e in GRAPH
              if top(e.source) in ("kernels", "adapters_registry") and top(e.target) == "app"]
    assert upward == []


def test_the_kernels_never_import_the_registry():
    assert [(e.source, e.target) for e in GRAPH
            if top(e.source) == "kernels" and top(e.target) == "adapters_registry"] == []


def test_only_kernels_vllm_touches_vllm_among_the_kernels():
    compute = [(e.source, e.target) for e in GRAPH if e.source.startswith("kernels.")
               and not e.source.startswith("kernels.vllm") and top(e.target) == "vllm"]
    assert compute == []


def test_the_oracle_is_for_tests_and_benchmarks_only():
    assert [e.source for e in GRAPH if e.target == "kernels.reference"] == []


def test_vllm_versions_are_named_in_one_table():
    pattern = re.compile(r"""["']0\.(24|32)\.?["']""")
    named = [name for name, path in product_modules().items() if pattern.search(path.read_text())]
    assert named == ["kernels.vllm.versions"]


def _dev_and_product_files():
    from tests.helpers.paths import REPO

    yield from product_modules().values()
    yield from sorted((REPO / "benchmarks").rglob("*.py"))
    yield from sorted((REPO / "tests" / "helpers").rglob("*.py"))


def test_version_guards_and_model_shapes_are_defined_once():
    """vLLM release numbers only in ``kernels.vllm.versions``; the GPT-OSS-20B and
    Qwen3-30B-A3B widths (as integers in code) only in ``benchmarks/shapes.py``."""
    import ast

    versions = re.compile(r"""["']0\.(24|32)\.?["']""")
    widths = {2880, 201088, 151936}
    guards, shapes = [], []
    for path in _dev_and_product_files():
        text = path.read_text()
        if versions.search(text):
            guards.append(path.name)
        if any(isinstance(n, ast.Constant) and n.value in widths for n in ast.walk(ast.parse(text))):
            shapes.append(path.name)
    assert guards == ["versions.py"] and shapes == ["shapes.py"], (guards, shapes)
