"""`BracketSearch`: which boundary the closed loop measures next, from everything it measured.

Note [Bracket search]: a check of the closed loop (Note [Closed loop]) looks for the largest
boundary ``n`` (blocks ``[0, n)`` offloaded) whose step-time overhead over keeping every block
is within its *limit*: the budget ``max_overhead``, or less where the saving is worth less
(the worth-it rule: at most ``saved / min_saving_per_overhead``). Step time grows with the
offloaded bytes, close to linearly, so every (keep, offload) pair measured at one boundary
says something about the others. The search keeps a *bracket*:

- ``lo``: the largest boundary known within: measured and passed (0, keeping every block, is
  known within: nothing moves);
- ``hi``: the smallest boundary known over: measured over (its pairs' lower bound over its
  limit), measured and undecided (after the most pairs allowed, or once more pairs could no
  longer bring its median within the limit: the cheaper side, it becomes the upper end and
  the boundaries below it are still searched), or *predicted* over. Every boundary above a
  known-over one counts as over too (more bytes cost more).

A check measures ``top`` (the rule's boundary) first and settles at ``lo`` when
``hi == lo + 1``: no boundary between the ends is ever skipped.

*A pass* needs the boundary's own median and an upper bound on it within its limit (outliers
cannot carry a boundary over it; the worth-it rule's limit is held to the same bound as the
budget: a one-block boundary 0.3% of a step over what its saving is worth passed on its median
in 4 of 4400 noisy scripted checks, above the best). The bound is the lower of two: on its own
pairs at ``pass_confidence`` (0.9: at least 4 pairs, all within), and, below ``top``, at
``confidence`` (0.8) on its own pairs together with the pairs of every larger boundary
measured in the check, each scaled to its bytes (an overhead per offloaded byte). ``top``
passes on its own pairs alone: nothing else stands between a noisy pass and steps over the
budget. Below it the pooled pairs give a tighter bound and count one outlier as one pair of
many; under convex costs (each byte dearer when more move, as on the 2-core machine: 3 blocks
+1.2%, 11 blocks +13.9%) they read high, and a larger boundary whose pairs were mostly
disturbed holds a pass back: then the boundary's own pairs can still carry it. Near the budget
no check of 60 steps is sure: on scripted linear costs (benchmarks/scripted_worlds.py: noise
up to 2% per block, 5% outlier steps, the best boundary anywhere from 1 to 11 of 12) a check
settled one block below the best in about 16% of 4400 checks and above it in about 0.15% (a
boundary 0.26% of the step over the budget, less than the noise of one pair, passed).

*Predictions* come only from measured pairs, with their bounds, and are made afresh after each
verdict. A boundary between ``lo`` and the nearest boundary measured above it is known over
without measuring it when the lower bounds of those two (keep: exactly 0), interpolated
linearly in offloaded bytes, put it over its limit. The next boundary measured is the largest
one in the bracket within its limit by a line through keep fitted to every pair measured in
the check (the median of them all, each scaled to its bytes: two disturbed pairs among three
cannot tilt it), or, when none is, the one fitted closest to its limit. On a linear cost the
rule's boundary, once measured over, points at the best boundary at once; the check measures
it and, unless the one above it is predicted over, that one too. Under convex costs a line
through measurements reads high between them and a line through keep reads wrong at both
ends: the check then measures more boundaries, and predictions only ever lower its result.
Note [Predictions under a knee]: on CUDA a transfer runs beside the compute and costs the step
nothing until the link is saturated, then almost all of what it does not hide: 0 up to a knee,
then close to linear (GPT-2 on the H100: ~4 of 12 blocks hide, a fifth costs ~16% of the step).
A line through keep then reads high below the knee, and interpolating it *predicts over* what
hides: a measured +260% at 11 blocks put one block over, and the check kept every block where 4
hid. Under a knee (``knee``, the loop's ``knee``: on CUDA, or ``tba.testing.GpuWorld``) a
boundary is predicted over only from the line through the lower bounds of the two nearest
measured boundaries above it, extended down (a convex cost lies above its secants outside
them: a lower bound), and the next boundary measured is the largest one within its limit on
the line through two boundaries measured over (past the knee that line is the cost); with only
the top measured over and nothing passed, the boundary below the top (the line's second point),
else the bracket's middle (or the keep line's choice when larger: exact on linear costs). Past
a convex knee the line through two points above extended down lies below the cost: its choice
is the knee's boundary or above it, and a second line through what it measured comes down to
it. Top, top - 1 and the knee's boundary settle in about 36 steps (benchmarks/gpu_worlds.py;
bisecting the bracket first, 3 of 110 H100-like runs, all at bound 9, ran out of their 60
steps).

Note [Worth it past a knee]: under a knee the overhead of a boundary past it is what its blocks
past the knee cost, and the worth-it rule averaged over all its blocks lets the blocks that
hide pay for them: one block past the knee of twelve at +1.9% (2% budget) saves 92% and is
"worth" up to 18%, for a last block that saves 8.3% of the bytes. Under a knee a boundary's
limit is also at most what its last block alone is worth (its bytes over all the blocks'
offloadable bytes, over ``min_saving_per_overhead``: 1.7% for one of twelve): the cost past
the knee has to be worth at least its last block, the one that made it cost. Without it the
H100-like world with 10 of 12 blocks hidden took 11 blocks in and out (benchmarks/gpu_worlds.py).

Note [Passes under a knee]: pairs of a boundary past the knee, scaled to the bytes of one
below it, read what the hidden boundary does not cost (a +50% past the knee, scaled, held a
boundary measured at +0.6% back at "at most +36%"). Under a knee a boundary below ``top``
passes on its own pairs alone, their upper bound at ``confidence`` (three pairs, their
largest; ``top`` still needs ``pass_confidence``): one pair (four steps) less per pass. A
boundary one block past the knee (+1.9% to +2.9% of the step in the H100-like worlds, against
1.7%) rarely reads all three pairs within: none of the sweep's 110 runs settled above the bound.

Tested in tests/cache/test_bracket_search.py, tests/cache/test_overhead_loop.py,
tests/cache/test_knee_loop.py (under a knee) and, on scripted worlds (``tba.testing.ScriptedWorld``), tests/cache/test_scripted_worlds.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from tba.cache.policy.paired_ratios import PairedOverhead, judge, median, median_bounds

__all__ = ["BracketSearch", "Outcome", "Verdict"]

Outcome = Literal["pass", "over", "undecided", "not worth it"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One measured boundary's verdict.

    Attributes:
        tail_start: the boundary (blocks ``[0, tail_start)`` offloaded).
        measured: its own (keep, offload) pairs, bounds at the search's ``confidence``.
        pooled_high: the upper bound a pass needs (Note [Bracket search]).
        pooled_from: the larger boundaries whose pairs, scaled, joined its own in that bound
            (none: the bound on its own pairs at the pass confidence was the lower).
        outcome: ``"pass"``, ``"over"`` (over the budget), ``"not worth it"`` (within the
            budget, over what its saving is worth) or ``"undecided"`` (no verdict after the
            most pairs: counted over).
        saved: its offloaded bytes over all the blocks' offloadable bytes.
        limit: the most overhead it may cost: the budget, or what its saving is worth.
    """

    tail_start: int
    measured: PairedOverhead
    pooled_high: float
    outcome: Outcome
    saved: float
    limit: float
    pooled_from: tuple[int, ...]

    def describe(self, max_overhead: float, pass_confidence: float) -> str:
        """``blocks [0, 3) +3.1% (bounds +2.2% to +4.0%, 3 pairs), saving 25%: within 5%``."""
        pooled = ""
        if self.pooled_from and not math.isinf(self.pooled_high):
            others = ", ".join(f"[0, {b})" for b in self.pooled_from)
            pooled = (f", at most {self.pooled_high:+.1%} with the pairs of blocks {others} "
                      "scaled to its bytes")
        elif not math.isinf(self.pooled_high) and self.pooled_high != self.measured.high:
            pooled = f", at most {self.pooled_high:+.1%} at {pass_confidence:.0%} confidence"
        head = (f"blocks [0, {self.tail_start}) {self.measured.describe()}{pooled}, "
                f"saving {self.saved:.0%}")
        budget = f"{max_overhead:.0%}"
        limit = budget if self.limit >= max_overhead else (
            f"{self.limit:.1%} (a saving of {self.saved:.0%} is worth no more)")
        return head + ": " + {
            "pass": f"within {limit}",
            "over": f"over {budget}",
            "undecided": (f"median over {limit}, the bounds cannot tell: counted over"
                          if self.measured.overhead > self.limit + 1e-9 else
                          f"cannot tell if within {limit}: counted over (the cheaper side)"),
            "not worth it": f"within {budget} but over {limit}: not worth it",
        }[self.outcome]


class BracketSearch:
    """The bracket over boundaries ``[0, top]`` of one check (Note [Bracket search]).

    Args:
        block_bytes: each block's offloadable bytes, in forward order.
        top: the largest boundary the check may settle at (the rule's, or the settled one
            when steady steps looked over the budget).
        max_overhead: the budget (0.05 = 5% over keeping every block).
        min_saving_per_overhead: the worth-it factor (saved fraction per overhead).
        confidence: of the bounds on one boundary's own pairs.
        pass_confidence: of the upper bound on ``top``'s own pairs a pass of ``top`` needs.
        knee: transfers overlap compute (CUDA): costs are 0 up to a knee, then close to
            linear; predictions and the next boundary follow Note [Predictions under a knee].
        known_within: a boundary known within before the check (steady steps showed it).
        known_over: boundaries above ``top`` known over before the check, with a lower bound
            on their overhead (steady steps showed it): under a knee they join the secants
            that predict over (Note [Steady steps far over]).

    Example:
        >>> search = BracketSearch([10] * 12, 11, max_overhead=0.05, min_saving_per_overhead=5,
        ...                        confidence=0.8, pass_confidence=0.9)
        >>> verdict = search.judge(11, [1.0] * 3, [1.16, 1.17, 1.165], pairs_left=2)
        >>> search.conclude(verdict)
        >>> verdict.outcome, search.next_candidate()  # the line through +16.5% crosses 5% at 3
        ('over', 3)
    """

    def __init__(
        self,
        block_bytes: Sequence[int],
        top: int,
        *,
        max_overhead: float,
        min_saving_per_overhead: float,
        confidence: float,
        pass_confidence: float,
        knee: bool = False,
        known_within: int = 0,
        known_over: Mapping[int, float] | None = None,
    ) -> None:
        self.max_overhead = max_overhead
        self.knee = knee  # Note [Predictions under a knee]
        self._under_knee = knee  # Note [Worth it past a knee], Note [Passes under a knee]
        self.min_saving_per_overhead = min_saving_per_overhead
        self.confidence = confidence
        self.pass_confidence = pass_confidence
        self.top = top
        total = sum(block_bytes)
        offloaded = [0]
        for num_bytes in block_bytes:
            offloaded.append(offloaded[-1] + num_bytes)
        # The fraction of the blocks' bytes boundary n offloads (its x in every fit).
        self._saved = [b / total if total > 0 else 0.0 for b in offloaded]
        self.lo = known_within  # the largest boundary known within
        self.hi = top + 1  # the smallest boundary known over (top + 1: none)
        self.hi_reason = ""
        self.verdicts: dict[int, Verdict] = {}  # measured boundaries, concluded
        self._known_low = {n: low for n, low in (known_over or {}).items() if n > top}
        self._ratios: dict[int, list[float]] = {}

    # ------------------------------------------------------------------ measuring
    def saved(self, n: int) -> float:
        """Blocks ``[0, n)``'s bytes over all the blocks' offloadable bytes."""
        return self._saved[min(n, len(self._saved) - 1)]

    def judge(
        self, n: int, keep_s: Sequence[float], offload_s: Sequence[float], *, pairs_left: int
    ) -> Verdict | None:
        """The verdict on boundary ``n`` from its adjacent ``(keep_s[i], offload_s[i])``
        pairs; None while it is undecided and ``pairs_left`` more pairs could still make it
        pass."""
        limit = self.limit(n)
        own = judge(keep_s, offload_s, limit, self.confidence)
        ratios = self._ratios[n] = [o / k - 1.0 if k > 0 else 0.0
                                    for k, o in zip(keep_s, offload_s)]
        bound = limit + 1e-9
        pooled_high, pooled_from = self._pass_bound(n)
        # A median within the limit after all the pairs allowed needs at least half of them
        # (the lower middle one) within it.
        num_within = sum(r <= bound for r in ratios)
        can_pass = num_within + pairs_left >= (len(ratios) + pairs_left + 1) // 2
        outcome: Outcome
        if own.low > bound:
            outcome = "over" if own.low > self.max_overhead + 1e-9 else "not worth it"
        elif own.overhead <= bound and pooled_high <= bound:
            outcome = "pass"
        elif pairs_left <= 0 or not can_pass:
            outcome = "undecided"
        else:
            return None
        return Verdict(n, own, pooled_high, outcome, self.saved(n), limit, pooled_from)

    def _scaled(self, n: int, pooled_from: Sequence[int]) -> list[float]:
        """The pairs of the boundaries ``pooled_from``, each scaled to ``n``'s bytes."""
        x = self.saved(n)
        return [r * x / self.saved(b) for b in pooled_from for r in self._ratios[b]]

    def _pass_bound(self, n: int) -> tuple[float, tuple[int, ...]]:
        """The upper bound a pass of ``n`` needs (Note [Bracket search]), and the larger
        boundaries whose pairs it rests on (none: ``n``'s own pairs at ``pass_confidence``)."""
        own = self._ratios[n]
        if self._under_knee and n < self.top:  # Note [Passes under a knee]
            return median_bounds(own, self.confidence)[1], ()
        alone = median_bounds(own, self.pass_confidence)[1]
        larger = tuple(sorted(b for b in self._ratios if b > n and self.saved(b) > 0))
        if larger:
            pooled = median_bounds(own + self._scaled(n, larger), self.confidence)[1]
            if pooled < alone:
                return pooled, larger
        return alone, ()

    def limit(self, n: int) -> float:
        """The most overhead boundary ``n`` may cost: the budget, or less when its saving is
        worth no more (the worth-it factor); under a knee, no more than its last block alone
        is worth (Note [Worth it past a knee])."""
        worth = self.saved(n)
        if self._under_knee and n > 0:
            worth = min(worth, self.saved(n) - self.saved(n - 1))
        return min(self.max_overhead, worth / self.min_saving_per_overhead)

    def conclude(self, verdict: Verdict) -> None:
        """Record a final verdict and place the bracket's ends again: ``hi`` is the smallest
        boundary measured over, or a smaller one the line between ``lo`` and it predicts
        over (predictions are made afresh from the nearest measurements each time)."""
        n = verdict.tail_start
        self.verdicts[n] = verdict
        if verdict.outcome == "pass":
            self.lo = max(self.lo, n)
        failed = [b for b, v in self.verdicts.items() if v.outcome != "pass"]
        self.hi = min(failed, default=self.top + 1)
        if failed:
            self.hi_reason = {"over": "measured over", "undecided": "undecided, counted over",
                              "not worth it": "measured not worth it"}[
                                  self.verdicts[self.hi].outcome]
        for j in range(self.lo + 1, self.hi):
            low = self.predicted_low(j)
            if low is not None and low > self.limit(j) + 1e-9:
                a, b = self._neighbours(j)
                below = f"blocks [0, {a})" if a else "keeping every block"
                self.hi = j
                self.hi_reason = (f"predicted over (at least {low:+.1%}, between the lower bounds "
                                  f"of {below} and blocks [0, {b}))")
                break

    # ------------------------------------------------------------------ predicting
    def _neighbours(self, j: int) -> tuple[int, int]:
        """The nearest measured boundaries below (0: keep) and above ``j`` (-1: none)."""
        below = [b for b in self.verdicts if b < j]
        above = [b for b in self.verdicts if b > j]
        return (max(below) if below else 0), (min(above) if above else -1)

    def predicted_low(self, j: int) -> float | None:
        """A lower bound on ``j``'s overhead: the lower bounds of the nearest measured
        boundaries below (keep: exactly 0) and above it, interpolated linearly in offloaded
        bytes; None without one above."""
        if self.knee:
            return self._secant_low(j)
        a, b = self._neighbours(j)
        if b < 0:
            return None
        low_a = self.verdicts[a].measured.low if a else 0.0
        low_b = self.verdicts[b].measured.low
        xa, xb, xj = self.saved(a), self.saved(b), self.saved(j)
        t = (xj - xa) / (xb - xa) if xb > xa else 0.0
        return low_a + t * (low_b - low_a)

    def _secant_above(self, j: int) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """(saved, lower bound) of the two nearest measured boundaries above ``j``, when their
        lower bounds rise with the bytes; else None."""
        lows = {**self._known_low, **{b: v.measured.low for b, v in self.verdicts.items()}}
        above = sorted(b for b in lows if b > j)[:2]
        if len(above) < 2:
            return None
        a, b = above
        la, lb = lows[a], lows[b]
        xa, xb = self.saved(a), self.saved(b)
        if not (xb > xa and lb > la):
            return None
        return (xa, la), (xb, lb)

    def _secant_low(self, j: int) -> float | None:
        """Under a knee: the line through the lower bounds of the two nearest measured
        boundaries above ``j``, extended down to it (below a convex cost's secant: a lower
        bound); None without two."""
        pair = self._secant_above(j)
        if pair is None:
            return None
        (xa, la), (xb, lb) = pair
        return la + (self.saved(j) - xa) * (lb - la) / (xb - xa)

    def _next_under_knee(self) -> int:
        """Note [Predictions under a knee]: with two boundaries measured over, the largest one
        in the bracket their line (through their medians) puts within its limit; else the
        bracket's middle, or the keep line's choice when that is larger."""
        middle = (self.lo + self.hi) // 2
        over = sorted(b for b, v in self.verdicts.items() if v.outcome != "pass" and b >= self.hi)
        if len(over) >= 2:
            a, b = over[:2]
            ra, rb = median(self._ratios[a]), median(self._ratios[b])
            xa, xb = self.saved(a), self.saved(b)
            if xb > xa and rb > ra:
                for j in range(self.hi - 1, self.lo, -1):
                    if ra + (self.saved(j) - xa) * (rb - ra) / (xb - xa) <= self.limit(j) + 1e-9:
                        return j
                return self.lo + 1
        if self.lo > 0:
            return middle
        if len(over) == 1 and over[0] == self.hi and self.hi - 1 > self.lo:
            return self.hi - 1  # Note [Predictions under a knee]: a second point for the line
        self.knee = False
        try:
            return max(self.next_candidate(), middle)
        finally:
            self.knee = True

    def fitted(self, j: int) -> float | None:
        """``j``'s overhead by a line through keep fitted to every pair measured in the check:
        the median of them all, each scaled to ``j``'s bytes (None before any)."""
        values = self._scaled(j, [b for b in self._ratios if self.saved(b) > 0])
        return median(values) if values else None

    @property
    def done(self) -> bool:
        """The bracket is one block wide: settle at ``lo``."""
        return self.hi <= self.lo + 1

    def next_candidate(self) -> int:
        """The boundary to measure next: the largest one in the bracket whose fitted overhead
        is within its limit, else the one fitted closest to its limit."""
        assert not self.done
        if self.knee:
            return self._next_under_knee()
        best, best_excess = self.lo + 1, math.inf
        for j in range(self.hi - 1, self.lo, -1):
            mid, limit = self.fitted(j), self.limit(j)
            if mid is None:
                continue
            if mid <= limit + 1e-9:
                return j
            excess = mid / limit if limit > 0 else math.inf
            if excess < best_excess - 1e-6:  # ties: the larger boundary
                best, best_excess = j, excess
        return best

    def describe(self) -> str:
        """The bracket, for the settle event: what is known within and over."""
        lo = (f"blocks [0, {self.lo}) within" if self.lo else "keeping every block within")
        if self.hi > self.top:
            return lo
        return f"{lo}, blocks [0, {self.hi}) {self.hi_reason}"
