"""Which step sizes the shape warm-up covers (the run on a real engine: tests/e2e/test_e2e_shape_warmup.py)."""

from __future__ import annotations

import math

import pytest

from app.engine.shape_warmup import int_class, routing_class, step_limit, token_counts


@pytest.mark.parametrize("limit", [1, 2, 3, 16, 17, 1615, 2047, 8192])
def test_counts_cover_each_power_of_two_class_aligned_and_unaligned(limit):
    counts = token_counts(limit)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == limit
    for k in range(int(math.log2(limit)) + 1):
        p = 2 ** k
        for d in (0, 1, 2, 4, 8):  # each power-of-two class of n at each launch bucket
            assert p + d in counts or p + d > limit
    # every count lies in a class (p, 2p] that holds a multiple of 16 and an unaligned count where it can
    assert all(1 <= n <= limit for n in counts)


@pytest.mark.parametrize("limit", [17, 1615, 8192])
def test_counts_hold_every_routing_class_up_to_the_limit(limit):
    warmed = {routing_class(n) for n in token_counts(limit)}
    assert warmed == {routing_class(n) for n in range(1, limit + 1)}


def test_the_step_sizes_the_compile_sweep_caught_share_a_warmed_class():
    """Sizes that compiled a routing kernel after the earlier warm-up (p and p + 1 only) on an H200
    (benchmarks/RESULTS.md): each now has a warmed size of its routing class, and 1032 and 1554,
    which compiled MXFP4 GEMM variants, the warmed 1032 and 1026 of their row-count classes."""
    counts = token_counts(8192)
    for n in (464, 479, 481):
        assert routing_class(n) in {routing_class(c) for c in counts}
    assert 1032 in counts and 1026 in counts
    assert (int_class(1554), int_class(4 * 1554)) == (int_class(1026), int_class(4 * 1026))


def test_int_class_is_tritons_integer_specialisation():
    assert [int_class(x) for x in (1, 16, 32, 17, 2, 0)] == ["1", "D", "D", "", "", "D"]


def test_counts_reject_an_empty_range():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        token_counts(0)


def test_step_limit_leaves_room_for_the_output_token():
    assert step_limit(8192, 2048) == 2047
    assert step_limit(512, 2048) == 512
    assert step_limit(16, 1) == 1
