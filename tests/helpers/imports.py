"""The import graph of the product packages, read from their source (``ast``): which module
imports which, at module level or inside a function."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.paths import REPO

PRODUCT = ("app", "kernels", "adapters_registry")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a submodule where ``from package import name`` names one)
    lazy: bool  # inside a function: runs when called, not when ``source`` is imported


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for top in PRODUCT for p in sorted((REPO / top).rglob("*.py"))}


def _resolve(source: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text())
    lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, lazy) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node.level, node.module)
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append(Import(name, sub if sub in known else target, lazy))
    return out


def import_graph() -> list[Import]:
    modules = product_modules()
    known = set(modules)
    return [i for name, path in modules.items() for i in imports_of(name, path, known)]


def cycles(edges: list[Import]) -> list[list[str]]:
    """Cycles among product modules (Tarjan's strongly connected components of size > 1)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target.split(".")[0] in PRODUCT:
            graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found
