"""Note [Bounds on the median ratio]: the median of paired step-time ratios and its
distribution-free bounds, on hand-computed cases and on a seeded simulation of their coverage."""

from __future__ import annotations

import math
import random

import pytest

from tba.cache.policy.paired_ratios import judge, median, median_bounds


def test_median() -> None:
    assert median([2.0]) == 2.0
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="tba: the median of no values"):
        median([])


@pytest.mark.parametrize(("n", "rank"), [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2), (7, 2), (8, 3), (9, 3)])
def test_bound_ranks_at_80_percent(n: int, rank: int) -> None:
    # P(Binomial(n, 1/2) <= rank - 1) <= 0.2 < P(Binomial(n, 1/2) <= rank): e.g. n=5: 1/32,
    # 6/32 <= 0.2 < 16/32; n=9: 46/512 <= 0.2 < 130/512.
    values = [float(i) for i in range(n)]
    low, high = median_bounds(values, 0.8)
    if rank == 0:
        assert (low, high) == (-math.inf, math.inf)
    else:
        assert (low, high) == (values[rank - 1], values[n - rank])


def test_bounds_cover_the_true_median_at_the_confidence() -> None:
    # Skewed, heavy-tailed step noise (a lognormal: other processes only add time) around a
    # true median ratio of +3%: each bound misses the median in at most 1 - 0.8 of the trials
    # (exactly 12.5% for 3 pairs, 18.75% for 5: the binomial tail, whatever the distribution).
    rng = random.Random(27)
    for n, miss in ((3, 0.125), (5, 0.1875)):
        above = below = 0
        trials = 4000
        for _ in range(trials):
            ratios = [0.03 + rng.lognormvariate(0.0, 0.8) - 1.0 for _ in range(n)]
            low, high = median_bounds(ratios, 0.8)
            above += low > 0.03
            below += high < 0.03
        assert above / trials == pytest.approx(miss, abs=0.02)
        assert below / trials == pytest.approx(miss, abs=0.02)


def test_judge_within_over_and_undecided() -> None:
    within = judge([1.0] * 3, [1.01, 1.05, 1.02], 0.05, 0.8)
    assert within.within is True and within.overhead == pytest.approx(0.02)
    assert (within.low, within.high) == pytest.approx((0.01, 0.05))  # the budget itself is within
    assert judge([1.0] * 3, [1.06, 1.08, 1.10], 0.05, 0.8).within is False
    # The run: offload steps +26% with one fast outlier (+3.7%), whose fastest steps
    # read +4.4% (2022 ms over the fastest keep step, 1937 ms). Three or four pairs cannot tell
    # (the outlier is the lower bound); from five the second smallest, +23.5%, is over.
    keep = [1.937, 1.950, 1.945, 1.960, 1.940]
    offload = [2.437, 2.022, 2.450, 2.420, 2.440]
    assert min(offload) / min(keep) - 1 == pytest.approx(0.044, abs=5e-4)
    assert judge(keep[:3], offload[:3], 0.05, 0.8).within is None
    assert judge(keep[:4], offload[:4], 0.05, 0.8).within is None
    result = judge(keep, offload, 0.05, 0.8)
    assert result.within is False and result.low == pytest.approx(2.420 / 1.960 - 1)
    assert result.overhead == pytest.approx(2.440 / 1.940 - 1)
    assert "+25.8% (bounds +23.5% to +25.8%, 5 pairs)" == result.describe()
    assert "no bound yet" in judge([1.0], [1.1], 0.05, 0.8).describe()
    with pytest.raises(ValueError, match="no \\(keep, offload\\) step pairs"):
        judge([], [], 0.05, 0.8)
