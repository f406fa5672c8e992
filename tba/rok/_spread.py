"""Spread of repeated samples, and when it makes a comparison meaningless (private module of :mod:`tba.rok`).

# Note [When a comparison means nothing]
Every ROK point is sampled several times (Note [Interleaved samples]); a comparison with keep
is made per pass (the strategy's sample over keep's sample of the same pass and batch), so
drift common to both cancels, and the spread of those per-pass ratios is what the machine's
noise does to the comparison. The summary reports the median ratio with its range
(min..max over passes) and calls the comparison meaningless when

  * there is only one pair: the spread is unknown (``--repeats 1``), or
  * the range is wider than the difference it is meant to show (``max - min > |median - 1|``)
    and wider than the noise floor (5 %): the samples cannot tell whether the strategy is
    faster or slower than keep, or by how much. A tight range around 1 (say 0.98..1.01) is a
    meaningful "no difference"; 1.52 with a range of 0.9..2.1 is not a 52 % gain.

With three passes the range is the whole sample: a conservative interval, not a confidence
interval; more passes narrow it only if the machine is quieter than the difference.
Tested in tests/benchmarks/test_rok_curve.py::test_meaningless_comparison_warning.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

__all__ = ["NOISE_FLOOR", "Spread", "comparison_warning", "spread"]

NOISE_FLOOR = 0.05


@dataclasses.dataclass(frozen=True)
class Spread:
    """Median, mean and range of ``n`` samples."""

    n: int
    median: float
    mean: float
    min: float
    max: float

    @property
    def relative(self) -> float:
        """``(max - min) / median``: the range as a fraction of the median (nan for a zero median)."""
        return (self.max - self.min) / abs(self.median) if self.median else math.nan

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "relative": self.relative}


def spread(values: Sequence[float]) -> Spread | None:
    """The spread of ``values`` (None for none)."""
    if not values:
        return None
    vals = [float(v) for v in values]
    return Spread(len(vals), statistics.median(vals), statistics.fmean(vals), min(vals), max(vals))


def comparison_warning(ratios: Sequence[float], noise_floor: float = NOISE_FLOOR) -> str | None:
    """Why per-pass ratios (strategy over keep) cannot support a comparison, or None when they can.

    See Note [When a comparison means nothing].

    Example:
        >>> comparison_warning([0.98, 0.99, 1.0]) is None
        True
        >>> comparison_warning([0.9, 1.52, 2.1])
        'ratios spread over 1.20 (0.90..2.10), more than the 0.52 difference from keep: cannot tell'
    """
    if not ratios:
        return "no pair with keep measured in the same pass"
    if len(ratios) < 2:
        return "one sample: its spread is unknown (run with --repeats >= 2)"
    s = spread(ratios)
    assert s is not None
    width, difference = s.max - s.min, abs(s.median - 1.0)
    if width > noise_floor and width > difference:
        return (f"ratios spread over {width:.2f} ({s.min:.2f}..{s.max:.2f}), more than the {difference:.2f} "
                f"difference from keep: cannot tell")
    return None
