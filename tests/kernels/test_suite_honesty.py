"""The kernel tests fail when the product is broken, never skip: the align kernel (which every
MoE-LoRA op runs first) is made to raise on purpose in a fresh pytest process, and the Triton
MoE-LoRA tests must report failures, with no skip other than the GPU-only ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.paths import REPO

BREAK_ALIGN = '''
def pytest_configure(config):
    from kernels.moe_lora import align

    def broken(*args, **kwargs):
        raise RuntimeError("the align kernel is broken on purpose")

    align.align_moe_lora = broken
    align.launch_align = broken
'''
GPU_ONLY = ("needs a CUDA GPU", "real model shapes need a CUDA GPU")


def test_a_broken_align_kernel_fails_the_moe_lora_tests(tmp_path):
    (tmp_path / "break_align.py").write_text(BREAK_ALIGN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    files = ["tests/kernels/test_triton_moe_lora.py", "tests/kernels/test_triton_moe_lora_rowmap.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "break_align",
                           "-p", "no:cacheprovider", *files], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    failed = int(re.search(r"(\d+) failed", out).group(1))
    assert failed >= 40, out[-3000:]  # nearly every test runs an op, so nearly every one fails
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all(any(reason in line for reason in GPU_ONLY) for line in skips), skips
