"""The offline wheelhouse tools: the project's pin files parse, the closure check finds missing
and conflicting requirements from the wheels' own metadata, and the host-side installer fails
with a message saying what to do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile

import pytest
from packaging.version import Version

from tests.helpers.paths import REPO

spec = importlib.util.spec_from_file_location("offline_bundle", REPO / "scripts" / "offline_bundle.py")
bundle = importlib.util.module_from_spec(spec)
sys.modules["offline_bundle"] = bundle  # dataclasses look their module up by name
spec.loader.exec_module(bundle)
TARGET = bundle.Target(python="3.12.3", glibc="2.39", arch="x86_64")


def fake_wheel(folder, name: str, version: str, requires: list[str]) -> object:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return bundle.load_wheel(path)


def test_the_project_pin_files_parse():
    pins = bundle.read_pins(REPO / "deploy" / "offline" / "gpu-requirements.txt")
    image = bundle.read_names(REPO / "deploy" / "offline" / "h200-image-packages.txt")
    assert pins["vllm"].version == Version("0.24.0") and pins["ray"].version == Version("2.60.0")
    assert "serve" in pins["ray"].extras and "torch" in image
    assert "torch" not in pins  # the image's torch is the one vLLM 0.24 needs


def test_closure_reports_missing_and_conflicting_requirements(tmp_path, capsys):
    wheels = {w.name: w for w in (
        fake_wheel(tmp_path, "app", "1.0", ["dep>=2", "imagepkg>=3", "absent", "skipped",
                                            'winonly; sys_platform == "win32"']),
        fake_wheel(tmp_path, "dep", "1.5", []),
    )}
    pins = {n: bundle.Pin(n, w.version, frozenset(), f"{n}=={w.version}") for n, w in wheels.items()}
    image = {"imagepkg": Version("2.0")}
    problems = bundle.check_closure(wheels, pins, image, {"skipped": None}, TARGET)
    assert any("conflict: app 1.0 requires dep>=2" in p for p in problems)
    assert any("the image has imagepkg==2.0" in p for p in problems)
    assert any("missing: app 1.0 requires absent" in p for p in problems)
    assert not any("winonly" in p or "skipped" in p for p in problems)  # marker / declared
    assert "not bundled (declared): skipped" in capsys.readouterr().out
    good = {"dep": fake_wheel(tmp_path, "dep", "2.1", [])}
    assert bundle.check_closure({**wheels, **good}, pins, {"imagepkg": Version("3.1")},
                                {"skipped": None, "absent": None}, TARGET) == []


def test_pins_must_be_exact_and_unique(tmp_path):
    for text in ("ray>=2.60\n", "ray==2.60.0\nRay==2.60.0\n"):
        (tmp_path / "req.txt").write_text(text)
        with pytest.raises(SystemExit):
            bundle.read_pins(tmp_path / "req.txt")


def test_installer_says_which_chunk_is_missing(tmp_path):
    env = dict(os.environ, LORAPLEX_PARTS=str(tmp_path / "parts"), LORAPLEX_SITE=str(tmp_path / "site"))
    out = subprocess.run(["bash", str(REPO / "scripts" / "offline_install.sh"), "recv", "97"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode != 0 and "no .c97/" in out.stderr and "send that chunk" in out.stderr
    out = subprocess.run(["bash", str(REPO / "scripts" / "offline_install.sh"), "install"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode != 0 and "offline_install:" in out.stderr
