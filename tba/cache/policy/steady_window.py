"""`SteadyWindow`: what the closed loop watches a settled boundary against.

Note [Steady window]: the closed loop (Note [Closed loop]) watches a settled boundary against
the *keep baseline*: the second fastest of the last timed keep steps (other work only ever adds
time: up to all but two disturbed keep steps leave it as it was, where their median followed
three of five), else the fastest; not against its own accepted time. A run of two keep steps
every ``keep_every`` steady steps refreshes the baseline (when the memory for it is free:
``can_keep``). Each timed steady step is read as its overhead over the baseline. When the
median of the last ``window`` of them (at least ``min_pairs``) is more than the boundary's
limit (``max_overhead``, or less where its saving is worth less), the boundary is checked
again at once, from ``[0, n]`` down: from the next step on at most half the steps offload
until the verdict, a boundary that went over the budget is measured over and backed off
within ``window + 4 * max_pairs`` steps, and the check settles within ``max_probe_steps``
(under a knee, a full window far over needs no measuring again: Note [Steady steps far
over]). Every ``recheck_every`` steady steps conditions are checked again from a new profile
(the rule, then a check): contention that went away is seen only by offloading again. Tested
in tests/cache/test_overhead_loop.py.
"""

from __future__ import annotations

import collections

from tba.cache.policy.paired_ratios import median

__all__ = ["SteadyWindow"]


class SteadyWindow:
    """The last ``num_keeps`` timed keep steps and the last ``window`` steady overheads.

    Example:
        >>> steady = SteadyWindow(window=3, num_keeps=5)
        >>> for seconds in (1.0, 1.3, 1.01):  # one keep step disturbed
        ...     steady.keep(seconds)
        >>> steady.baseline_s(), round(steady.add(1.0201), 4)
        (1.01, 0.01)
    """

    def __init__(self, *, window: int, num_keeps: int) -> None:
        self.keeps: collections.deque[float] = collections.deque(maxlen=num_keeps)
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def keep(self, seconds: float) -> None:
        """A timed keep step."""
        self.keeps.append(seconds)

    def baseline_s(self) -> float:
        """The keep baseline (Note [Steady window]); call only once a keep step was timed."""
        ordered = sorted(self.keeps)
        return ordered[1] if len(ordered) >= 3 else ordered[0]

    def overhead(self, seconds: float) -> float:
        """A step's overhead over the keep baseline."""
        baseline = self.baseline_s()
        return seconds / baseline - 1.0 if baseline > 0 else 0.0

    def add(self, seconds: float) -> float:
        """A timed steady step; returns the median overhead of the window."""
        self.recent.append(self.overhead(seconds))
        return median(self.recent)
