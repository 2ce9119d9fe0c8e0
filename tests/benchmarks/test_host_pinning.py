"""The pinning profile (``benchmarks.profiling.host_pinning``): its arena holds every tensor of a
real 3-D expert adapter read as vLLM reads it, side-by-side timing really overlaps, and on a CUDA
host the whole profile runs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from adapters_registry.manifest import BaseModelInfo
from benchmarks.profiling.host_pinning import arena_copy, beside, main
from benchmarks.profiling.lora_load import read_as_vllm
from benchmarks.synthetic_adapters import synthetic_adapter
from kernels.vllm.lora_pinning import host_tensors
from kernels.vllm.pinned_region import ALIGN


def test_the_arena_holds_every_tensor_aligned_and_equal(embedded_model_dir, tmp_path):
    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    folder = synthetic_adapter(tmp_path / "a", base, r=4, experts="3d", dtype="bfloat16")
    tensors = host_tensors(read_as_vllm(folder, base.num_experts))
    region, views = arena_copy(tensors, pin=False)
    buffer = region.buffer  # no CUDA here: the layout, not the page-locking
    assert len(views) == len(tensors) > 0
    assert all(v.shape == x.shape and v.dtype == x.dtype and torch.equal(v, x) for v, x in zip(views, tensors))
    starts = [v.data_ptr() - buffer.data_ptr() for v in views]
    assert all(s % ALIGN == 0 for s in starts) and starts == sorted(starts)
    ends = [s + v.numel() * v.element_size() for s, v in zip(starts, views)]
    assert all(e <= n for e, n in zip(ends, starts[1:] + [buffer.numel()]))  # no two views overlap


def test_beside_runs_the_background_while_the_work_is_timed():
    seen = []

    def background():
        time.sleep(0.2)
        seen.append(threading.current_thread().name)

    work_s, background_s = beside(lambda: time.sleep(0.05), background)
    assert 0.05 <= work_s < 0.2 <= background_s and seen and seen[0] != threading.current_thread().name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (page-locked memory, GPU copies)")
def test_the_profile_runs_on_a_cuda_host(embedded_model_dir, tmp_path, capsys):
    base = BaseModelInfo.from_model_dir(embedded_model_dir)
    folder = synthetic_adapter(tmp_path / "a", base, r=4, experts="3d", dtype="bfloat16")
    out = tmp_path / "pin.json"
    main([str(folder), "--experts", str(base.num_experts), "--reps", "1", "--steps", "3", "--launches", "10",
          "--matmuls", "2", "--json", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    assert run["pin"] > 0 and run["h2d_pageable"] > 0 and run["step_beside_pin_count"] >= 1
    assert "step_beside_pin" in capsys.readouterr().out
