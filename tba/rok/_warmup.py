"""How long a point of the ROK sweep warms up before it is measured (private module of :mod:`tba.rok`)."""

from __future__ import annotations

from typing import Any

from tba.settings import CLOSED_LOOP_MAX_PROBE_STEPS

__all__ = ["MAX_EXTRA_WARMUP", "Warmup", "sent_to_offloader", "settled_alike", "tail_start"]

# Warm-up of a policy strategy goes on (up to this many extra steps) until its decision holds:
# a closed-loop check measures at most CLOSED_LOOP_MAX_PROBE_STEPS steps after the profile,
# and a few more (a profile step again, two steps run alike) settle it.
MAX_EXTRA_WARMUP = CLOSED_LOOP_MAX_PROBE_STEPS + 4


def tail_start(cache: Any) -> int | None:
    """The first block the cache's policy keeps (None: no decision, or no cache)."""
    decision = getattr(cache, "adaptive_decision", None) if cache is not None else None
    return getattr(decision, "tail_start", None)


class Warmup:
    """How many warm-up steps a point runs: the sweep's, and for a deciding cache (one that
    decides from profiled and measured steps) as many more as it takes to decide and settle.

    # Note [Warm up until the policy settles]
    tba's adaptive policy profiles a step, then (closed loop) alternates steps that keep
    every block with steps that offload, to measure the overhead; budget mode may correct
    its boundary from a measured peak. Measuring those steps would time the policy's
    experiments, not its decision. So a deciding cache (the adaptive and budget strategies,
    and the fixed ones with ``--adaptive``) warms up until a decision exists and two
    consecutive steps ran it alike: the same boundary, and both sent tensors to the offloader or
    both none (``sent_to_offloader``: a store that ran or one cancelled because backward needed
    its tensor first; on a busy machine every store of an offloading step may be cancelled, so
    the bytes offloaded, which vary from step to step, cannot tell such a step from a keep
    step), and the closed loop, whose runs of keep steps look alike, reports no measurement
    under way (``settled_at_step``). Up to
    ``MAX_EXTRA_WARMUP`` steps more; a point that did not settle says so
    (``decision_unsettled``). Tested in
    tests/benchmarks/test_rok_curve.py::test_warmup_waits_for_the_policy_to_settle.

    Args:
        steps: the sweep's warm-up steps.
        cache: the point's tensor cache (None: no cache).
        deciding: whether the cache decides what to offload from measured steps.
    """

    def __init__(self, steps: int, cache: Any, deciding: bool) -> None:
        self.steps = steps
        self.cache = cache
        self.policy = cache is not None and deciding
        self.unsettled = ""
        self.previous: tuple[int | None, bool] | None = None
        if self.policy:
            profile_step = getattr(getattr(cache, "config", None), "profile_step", 1)
            self.steps = max(self.steps, profile_step + 1)
            self.limit = self.steps + MAX_EXTRA_WARMUP

    def after_step(self, completed: int) -> None:
        """Called after each warm-up step: extends the warm-up while the policy moves."""
        if not self.policy:
            return
        now = (tail_start(self.cache), sent_to_offloader(self.cache.stats()))
        decision = getattr(self.cache, "adaptive_decision", None)
        # The closed loop says when it measures (its runs of keep steps look alike).
        measuring = (getattr(decision, "max_probe_steps", None) is not None
                     and getattr(decision, "settled_at_step", None) is None)
        settled = settled_alike(self.previous, now) and not measuring
        self.previous = now
        if completed == self.steps and not settled:
            if self.steps < self.limit:
                self.steps += 1
            else:
                self.unsettled = (f"decision {'missing' if now[0] is None else 'still moving'} after "
                                  f"{completed} warm-up steps")


def sent_to_offloader(stats: Any) -> bool:
    """Whether a step's ``stats`` (a ``CacheStats``) show tensors sent to the offloader: a
    store that ran, or one cancelled because backward needed its tensor before the store ran
    (Note [Warm up until the policy settles]). A step that keeps every block sends none.

    Example:
        >>> from tba import CacheStats
        >>> sent_to_offloader(CacheStats(num_cancelled=3)), sent_to_offloader(CacheStats())
        (True, False)
    """
    return stats.num_offloaded > 0 or stats.num_cancelled > 0


def settled_alike(previous: tuple[int | None, bool] | None, now: tuple[int | None, bool]) -> bool:
    """Two consecutive steps ran one decision alike: ``(tail_start, sent anything)`` of
    each, see Note [Warm up until the policy settles].

    Example:
        >>> settled_alike((9, True), (9, True)), settled_alike((9, False), (9, True))
        (True, False)
    """
    return previous is not None and now[0] is not None and previous == now
