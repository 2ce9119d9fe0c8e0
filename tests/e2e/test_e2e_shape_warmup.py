"""The shape warm-up on the real stack: every live engine replica ran one step of every
token-count class before it took traffic (a phase of its logged start), base model and then
with LoRA in every slot, and vLLM's own step histogram shows the base-model steps."""

from __future__ import annotations

from app.engine.shape_warmup import token_counts
from tests.helpers.metrics_scrape import scrape_until

STEP_TOKENS = "ray_vllm_iteration_tokens_total"


def _steps_above(s, bound: float) -> float:
    """Engine steps, over the cluster, of more than ``bound`` tokens (vLLM's per-step token histogram)."""
    buckets = s.by(STEP_TOKENS + "_bucket", ("le",))
    edges = sorted((float(le), n) for (le,), n in buckets.items())
    assert edges, f"no {STEP_TOKENS} buckets in the scrape"
    at_or_below = max((n for le, n in edges if le <= bound), default=0.0)
    return s.total(STEP_TOKENS + "_count") - at_or_below


def test_every_replica_warmed_each_token_count_class_before_serving(serve_stack, replica_probe):
    live = [v for v in replica_probe.replicas() if v.get("engine_alive")]
    assert len(live) == 2, f"expected two live engine replicas, saw {[v['replica'] for v in live]}"
    for view in live:
        report = view["shape_warmup"]
        assert report is not None, f"replica {view['replica']} ran no shape warm-up"
        assert report["limit"] >= 1024, report  # the session stack's max_model_len is 2048
        assert report["token_counts"] == token_counts(report["limit"]), report
        assert len(report["seconds"]) == len(report["token_counts"]) and min(report["seconds"]) > 0, report
        # the same counts again with an adapter in every slot (vLLM's dummy adapters, in the workers)
        assert report["lora_active"] > 0 and report["lora_error"] is None, report
        assert len(report["lora_seconds"]) == len(report["token_counts"]) and min(report["lora_seconds"]) > 0, report
        phases = view["start_phases"]
        assert [p["name"] for p in phases] == ["imports", "engine", "shape warm-up"], phases
        warm = phases[-1]["seconds"]
        assert warm >= report["total_s"] - 0.01 and all(p["seconds"] >= 0 for p in phases), phases

    # Each replica's warm-up ran steps of more than 1024 tokens; the suite's own prompts are far
    # shorter, so the engines' histogram can only hold these from the warm-up (or more).
    limit = min(v["shape_warmup"]["limit"] for v in live)
    large = [n for n in token_counts(limit) if n > 1024]
    assert large, limit
    want = len(live) * len(large)
    s = scrape_until(serve_stack, lambda s: _steps_above(s, 1024) >= want, timeout_s=60)
    steps = _steps_above(s, 1024)
    assert steps >= want, (f"{steps} engine steps of > 1024 tokens; the warm-ups alone make {len(live)} x {len(large)} "
                           f"({large}); buckets {sorted(s.by(STEP_TOKENS + '_bucket', ('le',)).items())}")
