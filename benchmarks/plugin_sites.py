"""A folder that registers one vLLM general plugin (``vllm.general_plugins``) through package
metadata only, for a child process's ``PYTHONPATH`` (the benchmarks' stock-server and routing
plugins, which the wheel must not carry)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.helpers.paths import REPO


def plugin_site(dest: Path, name: str, entry_point: str) -> Path:
    """``dest`` holding the entry point ``name = entry_point`` (``module:attr``) in a distribution
    named after the plugin (never the checkout's own: it would hide loraplex's plugin); returned."""
    spec = importlib.util.spec_from_file_location("register_entry_points",
                                                  REPO / "scripts" / "register_entry_points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_dist_info(dest, {"vllm.general_plugins": {name: entry_point}}, name=name.replace("_", "-"))
    return dest
