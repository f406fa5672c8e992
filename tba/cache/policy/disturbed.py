"""Disturbed steps: a timed step slowed by other work is no sample of a boundary's cost.

Note [Disturbed steps] (the closed loop with ``knee``: transfers that overlap compute): a step
slowed by other work (an outlier: on the H100 and in the acceptance's worlds 5% of steps,
10-40% slower) lands in a pair, and a pass needs an upper bound on the median that, with five
pairs, is their largest ratio: one disturbed offload step held a boundary that hides its
transfers back (counted over, the check settled four blocks below the bound). A timed step
more than ``CLOSED_LOOP_DISTURBED`` (5%) slower than the fastest of at least two of its kind in
the same measurement (keep steps, or offload steps at the candidate: other work only adds
time, and the kind's own noise is far smaller) is taken for disturbed and not a sample, the
later one or the earlier (a disturbed first step of its kind is found when a second one comes:
dropped only on arrival, it held a boundary four of twelve blocks below the bound back, at
+0.3% with one pair at +22.9%); the run goes on and measures another pair, at most
``CLOSED_LOOP_MAX_DISTURBED`` (2) times per boundary measured (a machine that is slow for good
is measured as it is). The steps still count in ``probe_steps``. Tested in
tests/cache/test_overhead_loop.py.
"""

from __future__ import annotations

from tba.settings import CLOSED_LOOP_DISTURBED as DISTURBED

__all__ = ["drop_disturbed"]


def drop_disturbed(same: list[float], allowed: int) -> int:
    """Remove from ``same`` (timed steps of one kind in one measurement) the slowest while it
    is more than ``DISTURBED`` slower than the fastest, at most ``allowed`` of them; returns
    how many were removed (Note [Disturbed steps]).

    Example:
        >>> steps = [1.30, 1.00, 1.01]
        >>> drop_disturbed(steps, 2), steps
        (1, [1.0, 1.01])
    """
    dropped = 0
    while dropped < allowed and len(same) >= 2 and max(same) > (1.0 + DISTURBED) * min(same):
        same.remove(max(same))
        dropped += 1
    return dropped
