"""A benchmark's plugin site beside the checkout's entry points: both are seen by vLLM's lookup.

On the GPU host the checkout's entry points (loraplex's vLLM plugin) come from a dist-info that
``scripts/register_entry_points.py`` writes; a benchmark puts its own plugin's site first on the
engine's ``PYTHONPATH``. ``importlib.metadata`` keeps one distribution per name, so the two must
not share one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_stack_parts.routes import PLUGIN_NAME as ROUTE_PLUGIN
from benchmarks.gpu_stack_parts.routes import plugin_site as route_site
from benchmarks.plugin_sites import plugin_site
from benchmarks.stacks.stock_plugin import PLUGIN_NAME as STOCK_PLUGIN
from tests.helpers.paths import REPO

LIST_PLUGINS = """
import json, sys
sys.path[:0] = sys.argv[1:]
from importlib.metadata import entry_points
print(json.dumps(sorted({ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}.items())))
"""


def _plugins_seen(*sites: Path) -> dict[str, str]:
    # -S: no site-packages, so an installed loraplex cannot stand in for the checkout's site
    out = subprocess.run([sys.executable, "-S", "-c", LIST_PLUGINS, *map(str, sites)], capture_output=True, text=True,
                         check=True, timeout=60)
    return dict(json.loads(out.stdout))


def _checkout_site(dest: Path) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "register_entry_points.py"), "--target", str(dest)],
                   check=True, capture_output=True, timeout=60)
    return dest


def test_a_plugin_site_first_on_the_path_keeps_the_checkouts_plugin_visible(tmp_path):
    checkout = _checkout_site(tmp_path / "site")
    seen = _plugins_seen(route_site(tmp_path / "route-plugin"), checkout)
    assert seen.get(ROUTE_PLUGIN) == "benchmarks.gpu_stack_parts.routes:register", seen
    assert seen.get("loraplex_moe_lora") == "kernels.vllm.plugin:register", seen


def test_two_benchmark_plugin_sites_and_the_checkout_are_all_seen(tmp_path):
    sites = [route_site(tmp_path / "a"), plugin_site(tmp_path / "b", STOCK_PLUGIN, "x.y:z"),
             _checkout_site(tmp_path / "site")]
    seen = _plugins_seen(*sites)
    assert {ROUTE_PLUGIN, STOCK_PLUGIN, "loraplex_moe_lora"} <= set(seen), seen
