"""Paired step-time ratios: their median and distribution-free bounds on it.

Note [Bounds on the median ratio]: the closed loop (Note [Closed loop]) times steps that keep
every block next to steps that offload, in pairs, and judges a boundary by the pairs' ratios
``offload / keep - 1``. Step times on a shared machine are not normal: other processes only
ever add time, in bursts, so one pair can read -20% or +60% among pairs reading +3%. The
judgement therefore uses the *median* of the ratios and bounds on it that assume nothing about
the distribution (the sign test's order statistics): if the true median were ``m``, each ratio
falls below ``m`` with probability 1/2 independently, so the ``k``-th smallest of ``n`` ratios
lies above ``m`` only when at most ``k - 1`` fell below, with probability
``P(Binomial(n, 1/2) <= k - 1)``. The lower bound is the ``k``-th smallest ratio for the largest
``k`` where that probability is at most ``1 - confidence``, the upper bound the ``k``-th
largest. With ``confidence`` 0.8: 3 or 4 pairs bound the median by their extremes (87.5%,
93.8%), 5 and 6 by the second smallest and second largest (81%, 89%). Fewer pairs than that
give no bound (infinite), so no verdict.

A boundary is *within* the budget when the upper bound is, *over* when the lower bound is
above it, and *undecided* otherwise: the loop then measures more pairs, and when it may not,
takes the cheaper side (fewer offloaded blocks), never the fastest sample. One fast outlier
among pairs reading +26% moves neither the median nor, from five pairs on, the lower bound.
Tested in tests/cache/test_paired_ratios.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

__all__ = ["PairedOverhead", "median", "median_bounds", "judge"]


def median(values: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count).

    Not ``statistics.median``: importing ``statistics`` loads more modules than ``import tba``
    should.

    Example:
        >>> median([3.0, 1.0, 2.0, 10.0])
        2.5
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("tba: the median of no values")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _bound_rank(n: int, confidence: float) -> int:
    """The largest ``k`` (1-based) whose ``k``-th smallest of ``n`` values is a lower bound on
    their median with at least ``confidence``; 0 when even the smallest is not."""
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1), growing with k
    while k < (n + 1) // 2:
        below += math.comb(n, k) / 2**n
        if below > 1.0 - confidence + 1e-12:
            break
        k += 1
    return k


def median_bounds(values: Sequence[float], confidence: float) -> tuple[float, float]:
    """One-sided bounds on the median of ``values``, each at ``confidence`` (Note [Bounds on
    the median ratio]); ``(-inf, inf)`` when there are too few values for any bound.

    Example:
        >>> median_bounds([0.26, 0.04, 0.27, 0.25, 0.26], 0.8)  # one fast outlier
        (0.25, 0.26)
        >>> median_bounds([0.01, 0.02], 0.8)
        (-inf, inf)
    """
    k = _bound_rank(len(values), confidence)
    if k == 0:
        return -math.inf, math.inf
    ordered = sorted(values)
    return ordered[k - 1], ordered[-k]


@dataclasses.dataclass(frozen=True)
class PairedOverhead:
    """One boundary's measurement: adjacent (keep, offload) step pairs.

    Attributes:
        num_pairs: pairs measured.
        keep_s: median keep step time.
        offload_s: median offload step time.
        overhead: median of the paired ratios ``offload / keep - 1``.
        low: lower bound on that median (``-inf``: too few pairs).
        high: upper bound on that median (``inf``: too few pairs).
        within: True when ``high`` is within the budget, False when ``low`` is over it, None
            when the pairs cannot tell.
    """

    num_pairs: int
    keep_s: float
    offload_s: float
    overhead: float
    low: float
    high: float
    within: bool | None

    def describe(self) -> str:
        """``+3.1% (bounds +1.0% to +4.2%, 5 pairs)``."""
        if math.isinf(self.low):
            bounds = "no bound yet"
        else:
            bounds = f"bounds {self.low:+.1%} to {self.high:+.1%}"
        return f"{self.overhead:+.1%} ({bounds}, {self.num_pairs} pairs)"


def judge(
    keep_s: Sequence[float], offload_s: Sequence[float], max_overhead: float, confidence: float
) -> PairedOverhead:
    """Judge adjacent ``(keep_s[i], offload_s[i])`` pairs against ``max_overhead``.

    Example:
        >>> judge([1.0] * 3, [1.01, 1.02, 1.03], 0.05, 0.8).within
        True
        >>> judge([1.0] * 5, [1.26, 1.04, 1.27, 1.25, 1.26], 0.05, 0.8).within
        False
    """
    pairs = list(zip(keep_s, offload_s))
    if not pairs:
        raise ValueError("tba: judging a boundary from no (keep, offload) step pairs")
    ratios = [o / k - 1.0 if k > 0 else 0.0 for k, o in pairs]
    low, high = median_bounds(ratios, confidence)
    bound = max_overhead + 1e-9  # inclusive, whatever the rounding
    within = True if high <= bound else False if low > bound else None
    return PairedOverhead(
        len(pairs), median(k for k, _ in pairs), median(o for _, o in pairs), median(ratios),
        low, high, within,
    )
