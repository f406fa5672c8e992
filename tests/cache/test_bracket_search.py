"""Note [Bracket search] alone: verdicts from a boundary's pairs and the larger boundaries'
pairs, the bracket's ends, predictions with their bounds and the next boundary to measure.
(The loop that feeds it step times: tests/cache/test_overhead_loop.py; scripted worlds in a
cache: tests/cache/test_scripted_worlds.py.)"""

from __future__ import annotations

import pytest

from tba.cache.policy.bracket_search import BracketSearch


def _search(top: int = 11, num_blocks: int = 12) -> BracketSearch:
    return BracketSearch([10] * num_blocks, top, max_overhead=0.05, min_saving_per_overhead=5.0,
                         confidence=0.8, pass_confidence=0.9)


def _pairs(*ratios: float) -> tuple[list[float], list[float]]:
    """Keep steps of 1 s and offload steps reading ``ratios`` over them."""
    return [1.0] * len(ratios), [1.0 + r for r in ratios]


def test_the_rule_boundary_passes_on_four_pairs_all_within() -> None:
    # Nothing measured above it: its own pairs at 90% (three pairs bound nothing at 90%).
    search = _search()
    assert search.judge(11, *_pairs(0.01, 0.02, 0.03), pairs_left=2) is None
    verdict = search.judge(11, *_pairs(0.01, 0.02, 0.03, 0.049), pairs_left=1)
    assert verdict is not None and verdict.outcome == "pass" and not verdict.pooled_from
    assert verdict.pooled_high == pytest.approx(0.049)
    # One pair over the budget among five: no pass, never on the median alone.
    search = _search()
    assert search.judge(11, *_pairs(0.01, 0.02, 0.03, 0.06), pairs_left=1) is None
    verdict = search.judge(11, *_pairs(0.01, 0.02, 0.03, 0.06, 0.02), pairs_left=0)
    assert verdict.outcome == "undecided"
    assert "cannot tell if within 5%: counted over (the cheaper side)" in verdict.describe(0.05, 0.9)


def test_over_and_counted_over_early() -> None:
    search = _search()
    verdict = search.judge(11, *_pairs(0.09, 0.1, 0.11), pairs_left=2)
    assert verdict.outcome == "over" and verdict.measured.low == pytest.approx(0.09)
    # A fast outlier keeps the lower bound down, but three of four pairs are over: whatever
    # the fifth, the median cannot come within. Counted over one pair early.
    verdict = _search().judge(11, *_pairs(0.1, -0.2, 0.1, 0.1), pairs_left=1)
    assert verdict.outcome == "undecided"
    assert "median over 5%, the bounds cannot tell: counted over" in verdict.describe(0.05, 0.9)


def test_a_pass_below_the_top_pools_the_larger_boundaries_pairs() -> None:
    # [0, 11) measured +6.6% (0.6% a block); [0, 6) reads +3% on three pairs of its own. With
    # the pairs of [0, 11) scaled to its bytes (+3.6%) the bound on the six is within 5%.
    search = _search()
    search.conclude(search.judge(11, *_pairs(0.066, 0.066, 0.066), pairs_left=2))
    verdict = search.judge(6, *_pairs(0.03, 0.03, 0.03), pairs_left=2)
    assert verdict.outcome == "pass" and verdict.pooled_from == (11,)
    assert verdict.pooled_high == pytest.approx(0.036)
    assert "at most +3.6% with the pairs of blocks [0, 11) scaled to its bytes" in (
        verdict.describe(0.05, 0.9))
    # Scaled pairs over the budget hold a pass back: [0, 11) at +11% scales to +6% at 6 ...
    search = _search()
    search.conclude(search.judge(11, *_pairs(0.11, 0.11, 0.11), pairs_left=2))
    assert search.judge(6, *_pairs(0.03, 0.03, 0.03), pairs_left=2) is None
    # ... until its own pairs carry it alone, as the rule's boundary's would: four, all
    # within (costs convex, or the larger boundary's pairs disturbed).
    verdict = search.judge(6, *_pairs(0.03, 0.03, 0.03, 0.03), pairs_left=1)
    assert verdict.outcome == "pass" and verdict.pooled_from == ()
    assert ", at most +3.0% at 90% confidence" not in verdict.describe(0.05, 0.9)  # = its high


def test_worth_it_is_judged_on_the_median_and_its_bound() -> None:
    # One block of twelve saves 8.3%: worth 1.67%. A median of +1.5% with a pair reading +4%
    # (within the 5% budget, over the worth-it limit) does not pass: the bound must be within
    # the limit too, or a boundary just over what it is worth passes on noise (above the best).
    search = _search(top=1)
    assert search.limit(1) == pytest.approx(0.1 / 6)
    assert search.judge(1, *_pairs(0.015, 0.015, 0.04, 0.01), pairs_left=1) is None
    verdict = search.judge(1, *_pairs(0.015, 0.015, 0.04, 0.01, 0.012), pairs_left=0)
    assert verdict.outcome == "undecided"
    verdict = _search(top=1).judge(1, *_pairs(0.015, 0.015, 0.016, 0.01), pairs_left=1)
    assert verdict.outcome == "pass"
    verdict = _search(top=1).judge(1, *_pairs(0.018, 0.018, 0.018), pairs_left=2)
    assert verdict.outcome == "not worth it"
    assert "within 5% but over 1.7% (a saving of 8% is worth no more): not worth it" in (
        verdict.describe(0.05, 0.9))


def test_the_bracket_and_predictions_made_afresh() -> None:
    search = _search()
    search.conclude(search.judge(11, *_pairs(0.11, 0.11, 0.11), pairs_left=2))
    # Between keep (0) and [0, 11) at +11% (1% a block): [0, 6) and up predicted over.
    assert (search.lo, search.hi) == (0, 6)
    assert search.hi_reason == ("predicted over (at least +6.0%, between the lower bounds of "
                                "keeping every block and blocks [0, 11))")
    assert search.next_candidate() == 5  # the line crosses 5% at 5 blocks
    # [0, 5) reads +2%: predictions are made again between it and [0, 11): their lower bounds
    # put [0, 7) at +5.0%, within, and [0, 8) at +6.5%: the upper end moves up again.
    search.conclude(search.judge(5, *_pairs(0.02, 0.02, 0.02), pairs_left=2))
    assert (search.lo, search.hi) == (5, 8)
    assert search.predicted_low(7) == pytest.approx(0.02 + 2 / 6 * 0.09)
    # The line through keep fitted to all six pairs (the median of them scaled to 7 blocks:
    # +2.8% from [0, 5), +7% from [0, 11)) puts [0, 7) at +4.9%: measured next.
    assert search.fitted(7) == pytest.approx(0.049)
    assert search.next_candidate() == 7
    search.conclude(search.judge(7, *_pairs(0.06, 0.06, 0.06), pairs_left=2))
    assert (search.lo, search.hi) == (5, 7) and search.next_candidate() == 6
    search.conclude(search.judge(6, *_pairs(0.04, 0.04, 0.04, 0.04), pairs_left=1))
    assert search.done and search.lo == 6
    assert search.describe() == "blocks [0, 6) within, blocks [0, 7) measured over"


def test_an_undecided_boundary_is_the_upper_end_and_nothing_below_is_skipped() -> None:
    search = _search(top=4, num_blocks=5)
    search.conclude(search.judge(4, *_pairs(0.0, 0.1, 0.0, 0.1, 0.0), pairs_left=0))
    assert (search.lo, search.hi) == (0, 4) and search.hi_reason == "undecided, counted over"
    # Its median (+0%) predicts every smaller boundary within: the largest is measured next.
    assert search.next_candidate() == 3
    search.conclude(search.judge(3, *_pairs(0.01, 0.01, 0.01), pairs_left=2))
    assert search.done and search.lo == 3
    assert search.describe() == "blocks [0, 3) within, blocks [0, 4) undecided, counted over"


def test_none_predicted_within_measures_the_closest_to_its_limit() -> None:
    # +16% at 4 of 6 blocks: 4% a block, over every limit (one block saves 16.7%, worth 3.3%;
    # two or more: the 5% budget). Closest to its limit: one block (4% against 3.3%).
    # Two fast pairs keep the lower bound of [0, 4) down: nothing is predicted over.
    search = _search(top=4, num_blocks=6)
    verdict = search.judge(4, *_pairs(0.16, -0.3, 0.16, -0.3, 0.16), pairs_left=0)
    assert verdict.outcome == "undecided"
    search.conclude(verdict)
    assert (search.lo, search.hi) == (0, 4) and search.next_candidate() == 1


def test_the_fitted_line_shrugs_off_disturbed_pairs() -> None:
    # Two of the rule's three offload steps were disturbed: [0, 11) reads +30% (truly +5.5%).
    # [0, 3) then reads +1.5% (four pairs: they pass alone). A line through the two medians
    # would cross 5% near 4 blocks; the line fitted to all seven pairs (their median, each
    # scaled) puts it at 10.
    search = _search()
    search.conclude(search.judge(11, *_pairs(0.055, 0.30, 0.35), pairs_left=2))
    assert search.hi == 11  # its lower bound, +5.5%, predicts nothing over below it
    search.conclude(search.judge(3, *_pairs(0.015, 0.015, 0.015, 0.015), pairs_left=1))
    assert search.lo == 3 and search.fitted(10) == pytest.approx(0.05)
    assert search.next_candidate() == 10


def test_the_examples_in_the_docstrings_run() -> None:
    import doctest

    from tba.cache.policy import (bracket_search, closed_loop, disturbed, look_up, paired_ratios,
                                  steady_window)

    for module in (bracket_search, closed_loop, disturbed, look_up, paired_ratios, steady_window):
        result = doctest.testmod(module, raise_on_error=False, verbose=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__
