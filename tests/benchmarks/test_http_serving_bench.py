"""``benchmarks.loadgen``: the generator at its tiniest settings against the real stack
(conftest's ``serve_stack``: every request served with exactly the requested tokens, timings
consistent, the JSON report round-trips), and its token accounting on hand-made streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.loadgen.client import run
from benchmarks.loadgen.report import print_table, read_report, write_report
from benchmarks.loadgen.spec import BenchReport, LoadSpec, RequestRecord, TargetSpec
from benchmarks.loadgen.sse import StreamState, finish_record
from benchmarks.loadgen.vllm_bench import vllm_bench_args, vllm_bench_plan
from benchmarks.loadgen.workload import model_vocab

BASE = "loraplex-base"
ADAPTER = "acme-support"


def _ordered(p) -> bool:
    return p is not None and 0 < p.p50 <= p.p90 <= p.p99


@pytest.mark.e2e
def test_tiny_sweep_against_the_real_stack(serve_stack, embedded_model_dir, tmp_path, capsys):
    vocab, special = model_vocab(embedded_model_dir)
    key = serve_stack.keys["acme"]
    target = TargetSpec(name="loraplex", base_url=serve_stack.base_url, base_model=BASE,
                        keys={BASE: key, ADAPTER: key})
    runs = []
    for conc in (1, 2):
        spec = LoadSpec(target=target, adapters=[ADAPTER], input_len=4, output_len=4, concurrency=conc,
                        num_requests=4, warmup_requests=2, vocab_size=vocab, exclude_token_ids=special)
        result = run(spec)
        runs.append(result)
        a = result.aggregate
        assert result.warmup_requests == 2 and result.warmup_failures == 0
        assert a.requests == 4 and a.failures == 0 and a.errors == {}
        assert [r.adapter for r in result.records] == [None, ADAPTER, None, ADAPTER]  # round-robin
        for r in result.records:
            assert r.ok and r.status == 200 and r.error is None
            assert r.token_source in ("usage-per-chunk", "usage-total")  # counted by the server
            assert r.output_tokens == 4 and r.prompt_tokens == 4
            assert 1 <= r.content_chunks <= 4 and len(r.itl_ms) <= 3
            assert 0 < r.ttft_ms <= r.e2e_ms
        assert a.token_mismatches == 0 and a.mean_output_tokens == 4
        for p in (a.ttft_ms, a.tpot_ms, a.e2e_ms):
            assert _ordered(p)
        assert a.ttft_ms.p50 <= a.e2e_ms.p50
        assert a.output_throughput_tok_s > 0 and a.tokens_per_s_per_request > 0
    # the same seed replays the same prompts: the server counted the same prompt tokens
    assert [r.prompt_tokens for r in runs[0].records] == [r.prompt_tokens for r in runs[1].records]

    report = BenchReport(date="-", cpus=None, workload={"input_len": 4, "output_len": 4}, runs=runs)
    path = tmp_path / "report.json"
    write_report(report, path)
    assert key not in path.read_text()  # keys never reach the report
    back = read_report(path)
    assert back.model_dump() == report.model_dump()
    assert back.runs[1].records[3].itl_ms == runs[1].records[3].itl_ms

    print_table(runs)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loraplex ")]
    assert [row.split()[1] for row in rows] == ["1", "2"]


def test_a_chunk_of_several_tokens_gives_that_many_gaps():
    state = StreamState("completions")
    for t, payload in [(1.0, '{"choices":[{"text":"a"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}'),
                       (1.2, '{"choices":[{"text":""}],"usage":{"prompt_tokens":3,"completion_tokens":2}}'),
                       (1.6, '{"choices":[{"text":"bc"}],"usage":{"prompt_tokens":3,"completion_tokens":3}}'),
                       (1.7, '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}'), (1.8, "[DONE]")]:
        state.add(t, payload)
    rec = RequestRecord(index=0, adapter=None, model=BASE, start_s=0, status=200, ok=False, expected_output_tokens=3)
    rec = finish_record(rec, state, t_send=0.5, t_end=1.9)
    assert rec.ok and rec.token_source == "usage-per-chunk" and rec.output_tokens == 3
    assert rec.content_chunks == 2 and rec.max_chunk_tokens == 2
    assert rec.itl_ms == pytest.approx([300.0, 300.0])  # 0.6 s carried two tokens
    assert rec.ttft_ms == pytest.approx(500.0) and rec.e2e_ms == pytest.approx(1400.0)
    assert rec.tokens_per_s == pytest.approx(2 / 0.6)


def test_total_usage_alone_is_spread_over_the_later_chunks():
    state = StreamState("completions")
    for t, payload in [(1.0, '{"choices":[{"text":"a"}]}'), (2.0, '{"choices":[{"text":"b"}]}'),
                       (4.0, '{"choices":[{"text":"c"}]}'), (4.1, '{"choices":[],"usage":{"completion_tokens":5}}')]:
        state.add(t, payload)
    rec = RequestRecord(index=0, adapter=None, model=BASE, start_s=0, status=200, ok=False, expected_output_tokens=5)
    rec = finish_record(rec, state, t_send=0.0, t_end=4.2)
    assert rec.token_source == "usage-total" and rec.output_tokens == 5
    assert rec.itl_ms == pytest.approx([500.0, 500.0, 1000.0, 1000.0])
    assert not rec.ok and "[DONE]" in rec.error  # the stream never said it was done


def test_vllm_bench_covers_one_key_unless_a_key_may_call_every_model():
    target = TargetSpec(name="x", base_url="http://127.0.0.1:1", base_model=BASE,
                        keys={BASE: "ka", "a1": "ka", "g1": "kg", "a2": "ka"})
    spec = LoadSpec(target=target, adapters=["a1", "g1", "a2"], input_len=1, output_len=1, concurrency=1,
                    num_requests=1, vocab_size=8)
    assert vllm_bench_plan(spec, None)[:3] == ([None, "a1", "a2"], "ka", True)
    assert vllm_bench_plan(spec, "operator")[:3] == ([None, "a1", "g1", "a2"], "operator", False)
    assert "tenant's key" in vllm_bench_plan(spec, "operator")[3]
    one_key = spec.model_copy(update={"target": target.with_one_key("operator")})
    assert vllm_bench_plan(one_key, "operator") == ([None, "a1", "g1", "a2"], "operator", False,
                                                    "the same key on both clients")


def test_vllm_bench_asks_the_server_for_what_our_phase_asks():
    target = TargetSpec(name="x", base_url="http://127.0.0.1:1", base_model=BASE, api_key="k")
    spec = LoadSpec(target=target, adapters=["a1"], input_len=4, output_len=7, concurrency=2,
                    num_requests=3, vocab_size=8)

    def body(s: LoadSpec) -> dict:
        argv = vllm_bench_args(s, [BASE, "a1"], Path("tok"), Path("out/r.json"))
        return json.loads(argv[argv.index("--extra-body") + 1])

    assert body(spec) == {"min_tokens": 7,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert body(spec.model_copy(update={"continuous_usage": False})) == {"min_tokens": 7}
