"""Looking up from a settled boundary: when a run above it means more blocks hide now.

Note [Looking up] (the closed loop with ``knee``): below a knee, steps at the settled boundary
cost nothing more when the link gets faster, so steady steps cannot show that more blocks would
hide now (a link doubling its bandwidth doubles the bound). Every ``keep_every`` steady steps,
halfway between the keep runs, a run of ``RUN`` steps offloads more: at the smallest boundary
above the settled one (up to the rule's) that was not measured *inconclusively*: never
measured, or last measured (or predicted) clearly over its limit. It moves the loop only when
the world changed: its timed step within that boundary's limit over the keep baseline *and*,
where the boundary was measured over before, more than half its limit below that measurement's
lower bound. Then a check of ``[c, rule]`` starts at once (``c`` known within), from the
middle of the bracket, not the rule's boundary: a doubled bound is found in three measurements
(about 40 steps). Without the second condition a look-up that read one noisy step within the
limit moved a settlement one block below the bound up to it, or the bound's neighbour (measured
+1.9% against 1.7%) in and out, in 20 of 110 runs of 500 steady steps; with only one block up,
a settlement whose block above was undecided never saw a doubling. A run past the knee costs
the exposed transfer of the boundary looked at, twice in ``keep_every`` steps.

Note [Steady steps far over] (with ``knee``): when the link slows, the settled boundary's steps
cost at once far more than its limit (halving the bound: +50% to +140%), and measuring it again
spends twelve steps of a 60-step budget on what the steady steps showed. When a full window of
steady steps is each more than twice the limit over the keep baseline, the boundary is *known
over* (its lower bound: the smallest of them) and the check bisects the boundaries below it,
the known lower bound joining the secants that predict over (Note [Predictions under a knee]).
A median of the window more than twice the limit that is not a full window of such steps
(outlier steps, 10-40% slower, three of five in a row about once in 800 steps) waits up to a
window of steps for one, and then checks the boundary again as before: outliers alone moved a
settlement in 3 of 33 runs of 500 steps before the loop waited. Tested in
tests/cache/test_overhead_loop.py and, on ``tba.testing.GpuWorld``,
tests/cache/test_gpu_world.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["LookUp"]


class LookUp:
    """What the closed loop knows of the boundaries above the settled one (Note [Looking
    up]): the lower bound of each one's last verdict that did not pass.

    Example:
        >>> look = LookUp()
        >>> look.record(5, 0.05)  # blocks [0, 5) measured over, at least +5%
        >>> look.target(4, 11, lambda n: 0.0167)
        5
        >>> look.moves_up(5, 0.02, 0.0167), look.moves_up(5, 0.001, 0.0167) is not None
        (None, True)
    """

    def __init__(self) -> None:
        self.lows: dict[int, float] = {}
        self.at: int | None = None  # the boundary of the running look-up

    def record(self, n: int, low: float | None) -> None:
        """Boundary ``n``'s verdict: a lower bound on its overhead, or None when it passed."""
        if low is None:
            self.lows.pop(n, None)
        else:
            self.lows[n] = low

    def target(self, settled: int, rule: int, limit: Callable[[int], float]) -> int:
        """The boundary to look up at: the smallest above ``settled`` (up to ``rule``) never
        measured or last measured clearly over its limit; else one block up."""
        for n in range(settled + 1, rule + 1):
            low = self.lows.get(n)
            if low is None or low > limit(n) + 1e-9:
                return n
        return settled + 1

    def moves_up(self, up: int, overhead: float, limit: float) -> str | None:
        """Why a look-up at ``up`` that ran ``overhead`` over the keep baseline shows that more
        may hide now, or None when it does not."""
        low = self.lows.get(up)
        if overhead > limit + 1e-9 or (low is not None and overhead >= low - limit / 2):
            return None
        self.lows.pop(up, None)
        return "" if low is None else f", last measured at least {low:+.1%}"

    @staticmethod
    def far_over(recent: Sequence[float], window: int, limit: float) -> bool:
        """Note [Steady steps far over]: a full window of steady steps, each more than twice
        ``limit`` over the keep baseline."""
        return len(recent) == window and min(recent) > 2 * limit
