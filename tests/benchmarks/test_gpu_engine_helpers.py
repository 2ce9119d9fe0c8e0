"""The CPU-checkable parts of the GPU end-to-end benchmarks (the runs themselves need an H200)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.engine.equality import compare
from benchmarks.engine.gpt_oss_dummy import _rebalance, write_model_dir


class _TinyGptOssLike(torch.nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(100, hidden)
        self.input_layernorm = torch.nn.Linear(1, hidden)  # only its ``.weight`` name matters
        self.router = torch.nn.Linear(hidden, 8)
        self.o_proj = torch.nn.Linear(hidden, hidden)
        self.sinks = torch.nn.Parameter(torch.full((4,), 1e-3))
        self.lm_head = torch.nn.Linear(hidden, 100, bias=False)
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 16, dtype=torch.uint8), False)
        self.w13_weight_scale = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.uint8), False)

    def named_parameters(self, *a, **k):  # vLLM's names end like these
        renames = {"input_layernorm.weight": "input_layernorm.norm.weight"}
        for name, p in super().named_parameters(*a, **k):
            yield renames.get(name, name), p


def test_rebalance_makes_routing_token_dependent_and_fills_mxfp4_bytes():
    m = _TinyGptOssLike()
    with torch.no_grad():
        for p in m.parameters():
            if p.is_floating_point():
                p.uniform_(-1e-3, 1e-3)
    sinks = m.sinks.detach().clone()
    counts = _rebalance(m, hidden=64, head_std=4.0)
    assert counts["norm"] == 1 and counts["router"] == 1 and counts["embedding"] == 1
    assert counts["mxfp4_scale"] == 1 and counts["mxfp4_blocks"] == 1
    assert torch.all(m.w13_weight_scale == 118)  # E8M0 2^-9, never the NaN code 255
    assert m.w13_weight.float().std() > 30  # uniform random bytes
    assert not m.router.bias.any() and not m.o_proj.bias.any()
    assert torch.equal(m.sinks.detach(), sinks)  # attention sinks untouched
    x = m.embedding.weight.detach()[:16]
    experts = (x @ m.router.weight.t()).topk(2, dim=-1).indices.unique().numel()
    assert experts >= 6  # of 8: tokens spread over the experts
    logits = x @ m.lm_head.weight.t()
    assert 1.0 < float(logits.std()) < 10.0


def test_model_dir_configs(tmp_path):
    bf16 = json.loads((write_model_dir(tmp_path, mxfp4=False) / "config.json").read_text())
    mx = json.loads((write_model_dir(tmp_path, mxfp4=True) / "config.json").read_text())
    assert "quantization_config" not in bf16 and mx["quantization_config"]["quant_method"] == "mxfp4"
    assert (bf16["hidden_size"], bf16["num_local_experts"], bf16["num_hidden_layers"]) == (2880, 32, 24)
    assert len(bf16["layer_types"]) == bf16["num_hidden_layers"]


def _pass(forced, greedy):
    return {"forced": forced, "greedy": greedy}


def test_compare_reports_logprob_gaps_and_first_divergence():
    a = _pass([[-1.0, -2.0], [-3.0]], [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-0.4, -0.5])])
    b = _pass([[-1.5, -2.0], [-3.25]], [([1, 2, 9], [-0.2, -0.2, -0.9]), ([4, 5], [-0.4, -0.5])])
    r = compare(a, b)
    assert r["forced_tokens"] == 3
    assert r["forced_max_abs"] == pytest.approx(0.5)
    assert r["forced_mean_abs"] == pytest.approx(0.75 / 3)
    assert r["greedy_identical"] == "1/2"
    assert r["greedy_first_divergence_min"] == 2
    # before divergence: |0.1| and 0 from the first request, 0 and 0 from the second
    assert r["greedy_mean_abs_before_divergence"] == pytest.approx(0.1 / 4)


def test_kernel_families_and_device_time_only():
    from types import SimpleNamespace

    from benchmarks.profiling.step_profile import family_ms, kernel_family

    assert kernel_family("_moe_lora_shrink_kernel") == "MoE-LoRA (loraplex)"
    assert kernel_family("_fused_moe_lora_kernel") == "MoE-LoRA (vLLM)"
    assert kernel_family("_lora_expand_kernel") == "dense LoRA (vLLM punica)"
    assert kernel_family("_dense_lora_shrink_kernel") == "dense LoRA (loraplex)"
    assert kernel_family("fused_moe_kernel") == "MoE base GEMMs"
    assert kernel_family("flash_fwd_splitkv_kernel") == "attention"
    assert kernel_family("nvjet_tst_128x64_64x4") == "dense GEMMs"
    assert kernel_family("void at::native::elementwise_kernel<...>") == "other"

    def ev(name, kind, us):
        return SimpleNamespace(name=name, device_type=f"DeviceType.{kind}", device_time_total=us)

    got = family_ms([ev("_moe_lora_expand_kernel", "CUDA", 1500.0),
                     ev("_moe_lora_expand_kernel", "CUDA", 500.0),
                     ev("aten::mm", "CPU", 9000.0),  # a CPU op: its kernels are counted once
                     ev("nvjet_x", "CUDA", 250.0)])
    assert got == {"MoE-LoRA (loraplex)": 2.0, "dense GEMMs": 0.25}


def test_runtime_calls_count_host_side_cuda_api_calls_only(capsys):
    from types import SimpleNamespace

    from benchmarks.profiling.runtime_calls import print_runtime_table, runtime_calls

    def ev(name, kind, us):
        return SimpleNamespace(name=name, device_type=f"DeviceType.{kind}", cpu_time_total=us)

    got = runtime_calls([ev("cudaLaunchKernel", "CPU", 10.0), ev("cuLaunchKernelEx", "CPU", 6.0),
                         ev("cudaStreamSynchronize", "CPU", 3000.0),
                         ev("cudaStreamSynchronize", "CPU", 1000.0),
                         ev("aten::mm", "CPU", 500.0),  # an operator, not an API call
                         ev("_moe_lora_expand_kernel", "CUDA", 80.0)])
    assert got == {"cudaLaunchKernel": (0.01, 1), "cuLaunchKernelEx": (0.006, 1),
                   "cudaStreamSynchronize": (4.0, 2)}
    print_runtime_table("t", 2, {"with adapters": got, "LoRA off": {}})
    out = capsys.readouterr().out
    assert "| `cudaStreamSynchronize` * | 2.000 / 1.0 | 0.000 / 0.0 |" in out
    assert "| `cudaLaunchKernel` | 0.005 / 0.5 | 0.000 / 0.0 |" in out


def test_step_tables_measure_added_time_against_the_last_column(capsys):
    from benchmarks.profiling.step_profile import print_tables

    with_k = {"_moe_lora_expand_kernel": (6.0, 48), "fused_moe_kernel": (40.0, 96)}
    idle_k = {"fused_moe_kernel": (40.0, 96)}
    off_k = {"fused_moe_kernel": (30.0, 96)}
    got = print_tables("t", 2, {"with adapters": (with_k, 100.0),
                                "LoRA on, no adapter": (idle_k, 90.0),
                                "LoRA off": (off_k, 80.0)}, top=5)
    assert got["columns"] == ["with adapters", "LoRA on, no adapter", "LoRA off"]
    assert got["families"]["with adapters"] == {"MoE-LoRA (loraplex)": 3.0, "MoE base GEMMs": 20.0}
    assert got["wall_ms_per_step"] == [50.0, 45.0, 40.0]
    out = capsys.readouterr().out
    # added = first column minus the last (the engine without LoRA), per step
    assert "| MoE base GEMMs | 20.000 | 20.000 | 15.000 | +5.000 |" in out
    assert "| wall time | 50.000 | 45.000 | 40.000 | +10.000 (1.25×) |" in out
    assert "| `fused_moe_kernel` | 20.000 | 15.000 | +5.000 | 48.0 / 48.0 |" in out


def test_prefill_phase_packs_prompts_per_step_within_the_step_budget():
    from argparse import Namespace

    from benchmarks.profiling.step_profile import phases

    def args(**kw):
        base = dict(prompts=16, prompt_len=1600, prompts_per_step=5, decode_steps=4,
                    vary_len=0, mixed_only=False)
        return Namespace(**{**base, **kw})

    (name, batches, max_tokens, steps), decode = phases(args())
    assert (name, max_tokens, steps) == ("prefill", 1, 3)
    assert [len(b) for b in batches] == [5, 5, 5] and len(batches[0][0]) == 1600
    assert decode[0] == "decode" and decode[3] == 4 and len(decode[1][0]) == 16
    with pytest.raises(SystemExit, match="exceeds the engine's 8192 tokens"):
        phases(args(prompts_per_step=6))
    varied, _ = phases(args(prompts=6, prompts_per_step=1, vary_len=3))
    assert [len(b[0]) for b in varied[1]] == [1600, 1599, 1598, 1597, 1600, 1599]
    assert phases(args(mixed_only=True)) == []  # --mixed-only: no prefill or decode profile


@pytest.mark.parametrize("tokens,requests", [(16, 16), (1616, 2), (8192, 6)])
def test_mapping_workload_is_one_adapter_per_request(tokens, requests):
    from benchmarks.kernels.lora_mapping import workload

    mapping, table = workload(tokens)
    assert len(mapping.index_mapping) == tokens and len(mapping.prompt_mapping) == requests
    assert set(mapping.prompt_mapping) <= set(table) | {0} and len(table) == 8
    per_request = 1 if tokens < 256 else 1600
    for t, lora_id in enumerate(mapping.index_mapping):
        assert lora_id == mapping.prompt_mapping[min(t // per_request, requests - 1)]


def test_trace_gaps_splits_steps_and_charges_idle_time_to_the_launching_op(tmp_path, capsys):
    import gzip
    import json

    from benchmarks.profiling.trace_gaps import report

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
                "dur": 2, "tid": tid, "args": {"correlation": corr}}

    def kernel(name, corr, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7,
                "args": {"correlation": corr}}

    events = [op("vllm::moe_forward", 0, 100), op("aten::mm", 1, 5), launch(1, 2),
              op("vllm::loraplex_dense_lora_linear", 20, 20), launch(2, 25), launch(3, 41),
              kernel("gemm", 1, 10, 10), kernel("_dense_lora_shrink_kernel", 2, 40, 10),
              kernel("moe", 3, 55, 5),  # 5 µs idle before it
              kernel("gemm", 4, 6000, 10), {"ph": "M", "name": "process_name"}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = report(str(path), step_gap_ms=2.0, min_kernels=2)
    assert [s["kernels"] for s in got["steps"]] == [3, 1]  # 5.9 ms apart: two steps
    first = got["steps"][0]
    assert abs(first["span_ms"] - 0.050) < 1e-9 and abs(first["busy_ms"] - 0.025) < 1e-9
    assert got["idle_by_kernel"] == {"_dense_lora_shrink_kernel": 20.0, "moe": 5.0}
    # the runtime call at 25 µs lies inside the dense op (innermost), the one at 41 µs in
    # moe_forward only
    assert got["idle_by_op"] == {"vllm::loraplex_dense_lora_linear": 20.0,
                                 "vllm::moe_forward": 5.0}
    assert "| 0 | 3 | 0.05 | 0.03 | 0.03 |" in capsys.readouterr().out
