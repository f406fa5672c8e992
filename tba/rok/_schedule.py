"""The order in which the ROK sweep takes its samples (private module of :mod:`tba.rok`).

# Note [Interleaved samples]
A loaded machine drifts: another process starts, the page cache fills, a core is taken for
a minute. Sampling one strategy after another (all of keep, then all of recompute, ...) hands
the drift to whichever strategy ran at the bad moment, and the curve shows it as a property
of the strategy (keep's throughput going down from batch 2 to 4). So the sweep takes its
samples in passes: every pass measures every (batch, strategy) point once, and within a pass
the strategies of one batch run back to back, so the samples compared at equal batch (same
pass, same batch) are seconds apart and drift hits them alike. The order of the strategies
rotates by one place each pass, so no strategy is always the first to run after a change of
batch. The first pass keeps the order given; the sweep puts ``keep`` first, so the budget
strategy (whose budget is a fraction of keep's measured peak) always finds keep's
measurement of its batch. A sweep stopped early (time budget, signal) has whole passes: every
point has as many samples as the others, give or take one.
Tested in tests/benchmarks/test_rok_curve.py::test_schedule_interleaves_strategies.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Sample", "interleaved"]


class Sample(NamedTuple):
    """One run of one strategy at one batch size; ``repeat`` is the pass it belongs to."""

    repeat: int
    batch_size: int
    strategy: str


def interleaved(strategies: list[str] | tuple[str, ...], batch_sizes: list[int], repeats: int) -> list[Sample]:
    """Every (strategy, batch) point ``repeats`` times, in the order of Note [Interleaved samples].

    Example:
        >>> [s.strategy for s in interleaved(["keep", "recompute", "offload-ssd"], [2], 2)]
        ['keep', 'recompute', 'offload-ssd', 'recompute', 'offload-ssd', 'keep']
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected an integer >= 1")
    if len(set(strategies)) != len(strategies) or len(set(batch_sizes)) != len(batch_sizes):
        raise ValueError(f"strategies {list(strategies)} and batch sizes {batch_sizes} must not repeat")
    n = len(strategies)
    out: list[Sample] = []
    for r in range(repeats):
        order = [strategies[(i + r) % n] for i in range(n)]
        out.extend(Sample(r, b, s) for b in batch_sizes for s in order)
    return out
