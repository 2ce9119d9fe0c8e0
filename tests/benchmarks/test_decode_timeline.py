"""The decode timeline's reading of a Chrome trace: steps, the decode steps among them, costs
per kernel and family with the idle time charged to the kernel that ends it, one layer."""

import gzip
import json

import pytest

from benchmarks.profiling.decode_timeline import main, report


def _kernel(name: str, ts: float, dur: float) -> dict:
    blocks = 0.5 if name.startswith("_dense") else 2.0  # the profiler's "blocks per SM"
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7,
            "args": {"blocks per SM": blocks}}


def _write(path, steps: list[list[tuple[str, float, float]]], step_period: float = 1000.0):
    """Each step's kernels as (name, start µs within the step, duration µs)."""
    events = [_kernel(n, i * step_period + ts, d) for i, ks in enumerate(steps) for n, ts, d in ks]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


LAYER = [("flash_fwd_kernel", 0, 10), ("nvjet_gemm", 10, 20), ("fused_moe_kernel", 30, 40)]


def _decode(with_lora: bool) -> list[tuple[str, float, float]]:
    ks, t = [], 0.0
    for _ in range(3):  # three layers
        for name, _, dur in LAYER:
            if with_lora and name == "fused_moe_kernel":
                ks.append(("_dense_lora_shrink_kernel", t, 5))
                t += 5 + 2  # 2 µs idle before the base GEMM
            ks.append((name, t, dur))
            t += dur
    return ks


def test_decode_steps_costs_and_layer(tmp_path, capsys):
    prefill = [(n, ts * 3, d * 3) for n, ts, d in _decode(True)][:4]  # another kernel count
    lora = _write(tmp_path / "a.json.gz", [prefill] + [_decode(True)] * 4)
    base = _write(tmp_path / "b.json.gz", [_decode(False)] * 3)
    out = report([("with", lora), ("off", base)], step_gap_ms=0.3, layer=1)
    assert out["summary"]["with"]["steps"] == 4 and out["summary"]["off"]["steps"] == 3
    assert out["summary"]["with"]["kernels"] == 12 and out["summary"]["off"]["kernels"] == 9
    assert out["summary"]["with"]["busy_ms"] == pytest.approx((3 * 70 + 3 * 5) / 1e3)
    assert out["summary"]["with"]["idle_ms"] == pytest.approx(3 * 2 / 1e3)
    gemm = out["kernels"]["with"]["fused_moe_kernel"]
    assert gemm == {"launches": 3, "busy_us": 120, "idle_us": 6,  # the gaps it ended
                    "blocks_per_sm": 2.0}
    assert out["kernels"]["with"]["_dense_lora_shrink_kernel"]["blocks_per_sm"] == 0.5
    assert out["families"]["with"]["dense LoRA (loraplex)"]["launches"] == 3
    assert "dense LoRA (loraplex)" not in out["families"]["off"]
    layer = out["layer"]["with"]
    assert [r["name"] for r in layer] == ["flash_fwd_kernel", "nvjet_gemm",
                                          "_dense_lora_shrink_kernel", "fused_moe_kernel"]
    assert layer[-1]["idle_us"] == 2 and layer[0]["start_us"] == 0
    text = capsys.readouterr().out
    assert "| with | 4 / 5 | 12 |" in text
    assert "(+0.021 ms: kernels +0.015, idle +0.006)" in text


def test_a_layer_of_several_attention_kernels_is_cut_at_the_one_launched_once_per_layer(tmp_path):
    """vLLM's FlashAttention path launches a KV-cache write, a split plan, the attention (under
    two names: sliding-window and full layers alternate) and a combine per layer: the layer runs
    from one KV-cache write to the next, not from one attention kernel to the next."""
    ks, t = [], 0.0
    for i in range(4):
        attn = "flash_fwd_sm90<sliding>" if i % 2 else "flash_fwd_sm90<full>"
        for name, dur in [("reshape_and_cache_flash_kernel", 2), ("prepare_varlen_num_blocks_kernel", 2),
                          (attn, 10), ("flash_fwd_combine_kernel", 2), ("nvjet_gemm", 20),
                          ("_moe_lora_shrink_kernel", 5)]:
            ks.append((name, t, dur))
            t += dur
    path = _write(tmp_path / "d.json.gz", [ks] * 3)
    layer = report([("x", path)], step_gap_ms=0.3, layer=1)["layer"]["x"]
    assert [r["name"] for r in layer] == ["reshape_and_cache_flash_kernel", "prepare_varlen_num_blocks_kernel",
                                          "flash_fwd_sm90<sliding>", "flash_fwd_combine_kernel", "nvjet_gemm",
                                          "_moe_lora_shrink_kernel"]
    assert report([("x", path)], step_gap_ms=0.3, layer=3)["layer"] == {}  # no marker after the 4th layer


def test_step_start_splits_steps_without_idle_between_them(tmp_path):
    steps = [_decode(False)] * 3
    path = _write(tmp_path / "c.json.gz", steps, step_period=210.0)  # back to back: one step
    assert report([("x", path)], step_gap_ms=0.3)["summary"]["x"]["steps"] == 1
    # each step starts at its first attention kernel: split there, every 3rd one (layer 0)
    got = report([("x", path)], step_start="flash", step_gap_ms=0.3)["summary"]["x"]
    assert got["kernels"] == 3 and got["steps"] == 9


def test_cli_rejects_a_trace_without_a_label(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.json.gz")])


def test_expected_steps_split_a_trace_without_gaps_at_a_once_per_step_kernel(tmp_path):
    """Steps back to back, each opening with a kernel of its own (launched once per step): with
    ``expect_steps`` the trace is split there."""
    step = [("embed_kernel", 0, 5)] + [(n, ts + 5, d) for n, ts, d in _decode(False)]
    path = _write(tmp_path / "d.json.gz", [step] * 4, step_period=215.0)
    assert report([("x", path)], step_gap_ms=0.3)["summary"]["x"]["steps"] == 1
    got = report([("x", path)], step_gap_ms=0.3, expect_steps=4)["summary"]["x"]
    assert got["steps"] == 4 and got["kernels"] == 10
