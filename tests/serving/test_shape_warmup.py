"""Which step sizes the shape warm-up covers (the run on a real engine: tests/e2e/test_e2e_shape_warmup.py)."""

from __future__ import annotations

import math

import pytest

from app.engine.shape_warmup import step_limit, token_counts


@pytest.mark.parametrize("limit", [1, 2, 3, 16, 17, 1615, 2047, 8192])
def test_counts_cover_each_power_of_two_class_aligned_and_unaligned(limit):
    counts = token_counts(limit)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == limit
    for k in range(int(math.log2(limit)) + 1):
        p = 2 ** k
        assert p in counts
        assert p + 1 in counts or p + 1 > limit
    # every count lies in a class (p, 2p] that holds a multiple of 16 and an unaligned count where it can
    assert all(1 <= n <= limit for n in counts)


def test_counts_reject_an_empty_range():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        token_counts(0)


def test_step_limit_leaves_room_for_the_output_token():
    assert step_limit(8192, 2048) == 2047
    assert step_limit(512, 2048) == 512
    assert step_limit(16, 1) == 1
