"""The closed loop under a knee (``OverheadLoop.knee``: transfers overlap compute, as on CUDA):
Note [Worth it past a knee], Note [Looking up], Note [Steady steps far over] and Note
[Disturbed steps], on scripted step times; no assertion rests on real time. (Whole GPU worlds
in a cache: tests/cache/test_gpu_world.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tba.cache.policy.bracket_search import BracketSearch
from tba.cache.policy.closed_loop import OverheadLoop
from tba.cache.policy.look_up import LookUp

Cost = Callable[[int], float]


def _knee(bound: int, first: float = 0.019, slope: float = 0.15) -> Cost:
    """Overhead of boundary ``at``: none up to ``bound`` blocks, ``first`` one block past it,
    then ``slope`` per block."""
    return lambda at: 0.0 if at <= bound else first + slope * (at - bound - 1)


def _run(loop: OverheadLoop, at: int, cost: Cost, steps: int,
         slow: Callable[[int, int], float] = lambda i, at: 0.0,
         ran: list[int] | None = None) -> int:
    """``steps`` steps of 1 s plus ``cost`` (and ``slow(i, at)``) from boundary ``at``;
    returns the next boundary (``ran`` collects the boundaries run)."""
    for i in range(steps):
        if ran is not None:
            ran.append(at)
        nxt = loop.observe(at, 1.0 + cost(at) + slow(i, at))
        assert nxt is not None, loop.reason
        at = nxt
    return at


def _settled(bound: int, cost: Cost | None = None) -> tuple[OverheadLoop, int]:
    loop = OverheadLoop(0.02)
    loop.knee = True
    at = _run(loop, loop.start(11, [10] * 12), cost or _knee(bound), 60)
    assert not loop.probing and loop.candidate == bound, loop.reason
    return loop, at


def _events(loop: OverheadLoop, after: int | None) -> list[tuple[str, int]]:
    return [(e.kind, e.tail_start) for e in loop.events if after is None or (e.step or 0) > after]


def test_past_a_knee_a_boundary_may_cost_what_its_last_block_is_worth() -> None:
    """One block past the knee costs +1.9%: within the 2% budget and within what 11 blocks'
    saving is worth (18%), but not what its last block's saving is (8.3% / 5 = 1.7%)."""
    args = dict(max_overhead=0.02, min_saving_per_overhead=5, confidence=0.8, pass_confidence=0.9)
    assert BracketSearch([10] * 12, 11, **args).limit(11) == pytest.approx(0.02)
    assert BracketSearch([10] * 12, 11, knee=True, **args).limit(11) == pytest.approx(1 / 60)
    lines = OverheadLoop(0.02)  # without a knee: a line, the average is the cost
    _run(lines, lines.start(11, [10] * 12), _knee(10), 60)
    assert lines.candidate == 11
    loop, _ = _settled(10)
    assert ("fail", 11) in _events(loop, None)


@pytest.mark.parametrize("bound", [10, 6])
def test_a_look_up_moves_only_when_clearly_below_what_was_measured(bound: int) -> None:
    """Settled at ``bound``, the block above measured (10: blocks [0, 11)) or predicted (6:
    blocks [0, 7), from the secant through 8 and 11) at +1.9%. Runs one block up that read
    +1.5% (within the 1.7% limit, but not clearly below +1.9%) move nothing in 400 steps; once
    the block hides (the link got faster) the next look-up starts a check."""
    loop, at = _settled(bound)
    settled_at = loop.settled_at_step
    ran: list[int] = []
    at = _run(loop, at, lambda n: 0.015 if n == bound + 1 else _knee(bound)(n), 400, ran=ran)
    assert _events(loop, settled_at) == [] and loop.candidate == bound
    assert ran.count(bound + 1) >= 2 * 15  # runs of two steps one block up, every 20 steady
    step = loop.events[-1].step
    _run(loop, at, lambda n: 0.0, 80)
    events = _events(loop, step)
    assert events[0] == ("suspect", bound + 1) and events[-1][0] == "settle", events
    assert loop.candidate > bound


def test_a_doubled_bound_is_searched_from_the_middle() -> None:
    """Settled at 4 (5 over); the link doubles its bandwidth: the look-up at 5 reads within,
    the check measures the middle of [4, 11] first, not the rule's 11, and settles at 8
    within 60 steps of the drift."""
    loop, at = _settled(4)
    _run(loop, at, _knee(8), 60)
    events = _events(loop, 60)
    assert events[:2] == [("suspect", 5), ("measure", 8)], events
    assert events[-1] == ("settle", 8) and loop.candidate == 8


def test_steady_steps_far_over_search_below_without_measuring_again() -> None:
    """Settled at 6; the bound halves: steady steps at +32%. Once a full window of them is
    over twice the limit, 6 is known over and the check bisects below it (never measuring 6
    again) and settles at 3 within 40 steps of the drift."""
    loop, at = _settled(6)
    settled_at = loop.settled_at_step
    _run(loop, at, _knee(3), 40)
    events = _events(loop, settled_at)
    assert events[0] == ("suspect", 6) and ("measure", 6) not in events, events
    assert events[-1] == ("settle", 3) and loop.candidate == 3


def test_three_outlier_steps_in_a_row_move_nothing() -> None:
    """Three steady steps in a row 20% slower (outliers, not a drift) put the window's median
    far over; the loop waits for a full window of them, which does not come."""
    dry, at = _settled(6)
    ran: list[int] = []
    _run(dry, at, _knee(6), 100, ran=ran)  # the same steps without outliers: where they run
    first = next(i for i in range(30, 100) if ran[i - 1:i + 3] == [6] * 4)
    loop, at = _settled(6)
    settled_at = loop.settled_at_step
    _run(loop, at, _knee(6), 100, slow=lambda i, at: 0.2 if first <= i < first + 3 else 0.0)
    assert _events(loop, settled_at) == [] and loop.candidate == 6


def test_a_disturbed_first_step_of_its_kind_is_dropped() -> None:
    """The first timed offload step is disturbed (+30%): it is dropped when the second comes
    (it is more than 5% slower than it), and the boundary passes on four undisturbed pairs."""
    loop = OverheadLoop(0.02)
    loop.knee = True
    _run(loop, loop.start(4, [10] * 12), lambda n: 0.0, 40,
         slow=lambda i, at: 0.3 if at == 4 and i == 3 else 0.0)
    assert loop.candidate == 4 and not loop.probing
    assert loop.probe_steps == 20  # one pair more than four


def test_a_look_up_skips_a_boundary_measured_inconclusively() -> None:
    """Settled at 4 with 5 undecided (at least +1.0%, under its 1.7% limit) and 6 over: a
    look-up at 5 could not read clearly below its measurement, so it looks at 6; a boundary
    never measured (predicted over without a bound) is looked at as it is."""
    look = LookUp()
    look.record(5, 0.010)
    look.record(6, 0.050)
    assert look.target(4, 11, lambda n: 1 / 60) == 6
    assert look.moves_up(6, 0.001, 1 / 60) is not None and 6 not in look.lows
    look.record(6, None)  # passed: nothing known of it
    assert look.target(4, 11, lambda n: 1 / 60) == 6
    assert look.target(4, 5, lambda n: 1 / 60) == 5  # nothing above: one block up


def test_under_a_knee_the_top_over_is_followed_by_the_block_below_and_their_line() -> None:
    """Bound 9: blocks [0, 11) at +12.6%; the next boundary is 10 (a second point past the
    knee), at +2.1%; the line through the two crosses the limit at 9, which passes on its
    own three pairs (pairs past the knee, scaled to its bytes, say nothing of it): settled
    after three boundaries, 36 steps (the H100-like world's bound-9 runs had run out of their
    60 steps bisecting)."""
    args = dict(max_overhead=0.02, min_saving_per_overhead=5, confidence=0.8,
                pass_confidence=0.9)
    search = BracketSearch([10] * 12, 11, knee=True, **args)
    keep = [1.0, 1.0, 1.0]
    search.conclude(search.judge(11, keep, [1.125, 1.126, 1.127], pairs_left=2))
    assert search.next_candidate() == 10
    search.conclude(search.judge(10, keep, [1.020, 1.021, 1.022], pairs_left=2))
    assert search.next_candidate() == 9
    verdict = search.judge(9, keep, [1.001, 1.002, 1.000], pairs_left=2)
    assert verdict is not None and verdict.outcome == "pass"
    search.conclude(verdict)
    assert search.done and search.lo == 9
    lines = BracketSearch([10] * 12, 11, **args)  # on a line the pooled pairs hold it back
    lines.conclude(lines.judge(11, keep, [1.125, 1.126, 1.127], pairs_left=2))
    lines.conclude(lines.judge(10, keep, [1.020, 1.021, 1.022], pairs_left=0))
    assert lines.judge(9, keep, [1.001, 1.002, 1.000], pairs_left=2) is None
