"""Extract vLLM's engine-argument names from a vLLM wheel's source, without importing vLLM.

Writes ``vllm_<version>_engine_args.json`` next to this script: the fields of ``EngineArgs`` and
``AsyncEngineArgs`` (name → annotation source), the ranks ``max_lora_rank`` accepts
(``MaxLoRARanks``), and the field names of ``CompilationConfig``. The deployment tests check the
Serve configs' engine arguments against this list, so CI needs neither vLLM's GPU wheel nor a GPU.

Usage (the wheel is only read, never installed)::

    pip download vllm==0.24.0 --no-deps -d <tmpdir>
    python tests/data/extract_vllm_engine_args.py <tmpdir>/vllm-0.24.0-*.whl
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def dataclass_fields(tree: ast.Module, class_name: str) -> dict[str, str]:
    """Annotated class-level assignments of ``class_name`` (dataclass fields), in source order."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            fields: dict[str, str] = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    annotation = ast.unparse(item.annotation)
                    if "ClassVar" not in annotation:
                        fields[item.target.id] = annotation
            return fields
    raise LookupError(f"class {class_name} not found")


def literal_values(tree: ast.Module, alias: str) -> list[object]:
    """The values of a module-level ``alias = Literal[...]``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == alias for t in node.targets):
            subscript = node.value
            assert isinstance(subscript, ast.Subscript), alias
            elts = subscript.slice.elts if isinstance(subscript.slice, ast.Tuple) else [subscript.slice]
            return [ast.literal_eval(e) for e in elts]
    raise LookupError(f"alias {alias} not found")


def extract(wheel: Path) -> dict[str, object]:
    with zipfile.ZipFile(wheel) as zf:
        read = lambda name: zf.read(name).decode()  # noqa: E731
        version_src = read("vllm/_version.py")
        arg_utils = ast.parse(read("vllm/engine/arg_utils.py"))
        lora = ast.parse(read("vllm/config/lora.py"))
        compilation = ast.parse(read("vllm/config/compilation.py"))
    match = re.search(r"__version__ = version = '([^']+)'", version_src)
    if not match:
        raise LookupError("vllm/_version.py has no __version__")
    engine_args = dataclass_fields(arg_utils, "EngineArgs")
    async_only = dataclass_fields(arg_utils, "AsyncEngineArgs")
    return {
        "vllm_version": match.group(1),
        "source": f"{wheel.name}: vllm/engine/arg_utils.py, vllm/config/lora.py, vllm/config/compilation.py",
        "engine_args": engine_args,
        "async_engine_args_only": async_only,
        "max_lora_ranks": literal_values(lora, "MaxLoRARanks"),
        "compilation_config_fields": sorted(dataclass_fields(compilation, "CompilationConfig")),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    data = extract(Path(argv[1]))
    out = HERE / f"vllm_{data['vllm_version'].replace('.', '_')}_engine_args.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{out.name}: {len(data['engine_args'])} EngineArgs fields, "
          f"{len(data['async_engine_args_only'])} AsyncEngineArgs-only")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
