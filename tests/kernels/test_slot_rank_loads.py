"""Reading slot ranks keeps the kernels' loads as wide as reading whole stacks: the kernels
compiled for sm_90 (Triton's NVIDIA backend and its ptxas, no GPU needed) have no more 16-bit
loads with slot ranks than without. A bound along B's contiguous rank axis that the compiler
cannot prove a multiple of the vector width turns B's 16-byte loads into 2-byte ones (the first
slot-rank version did: 64 scalar loads per B tile, slower than the whole stack on an H100)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_slot_rank_variants_keep_their_loads_vectorised():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "tests.helpers.ptx_loads"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    loads = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(loads) == {"moe_shrink", "moe_expand", "moe_expand_fold", "moe_fused",
                          "dense_expand", "dense_fused"}
    for kernel, variants in loads.items():
        whole, ranked = variants["whole"], variants["ranked"]
        assert sum(whole.values()) > 0, (kernel, whole)  # the count sees the kernel's loads
        assert ranked.get("ld.global.b16", 0) <= whole.get("ld.global.b16", 0), (kernel, variants)
        for wide in ("ld.global.v4.b32", "cp.async.cg.shared.global"):
            assert ranked.get(wide, 0) == whole.get(wide, 0), (kernel, wide, variants)
