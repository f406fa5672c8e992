"""Turning a rank's schedule into ``set_stage`` hints, shared by every integration.

Each integration reduces its scheduler's plan for this rank to an ordered list of
:class:`Step` (stage, microbatch, action). When the scheduler starts a step, the integration
calls :meth:`Plan.announce`, which tells the cache serving that stage what runs now and what
*that same cache* runs next.

# Note [one cache per stage module]
With several stages on one rank (interleaved schedules) each stage module may have its own
cache. A cache can only prefetch its own tensors, so its look-ahead is the next step *it*
will serve, skipping other caches' steps in between: the cache of stage 0 running ``0F3`` is
told ``next = 0B2`` even when ``2B1`` (another cache) runs in between, and can load ``0B2``'s
tensors behind ``2B1``'s compute. When one cache serves several stages (registered on a
parent module) the look-ahead is simply the next step of the rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tba.cache.steps.stages import Action
from tba.integrations.registry import CacheLike

__all__ = ["Action", "Step", "Plan", "announce"]

logger = logging.getLogger(__name__)


class Step(NamedTuple):
    """One compute step of a schedule, as the cache sees it."""

    stage: int
    microbatch: int
    action: Action


def announce(cache: CacheLike, step: Step, nxt: Step | None) -> None:
    """Call ``cache.set_stage`` for ``step`` with ``nxt`` as the look-ahead."""
    cache.set_stage(
        microbatch=step.microbatch,
        action=step.action,
        stage=step.stage,
        next_microbatch=None if nxt is None else nxt.microbatch,
        next_action=None if nxt is None else nxt.action,
        next_stage=None if nxt is None else nxt.stage,
    )


class Plan:
    """One rank's steps for one schedule run, with a cursor that follows execution.

    Args:
        steps: the rank's compute steps in schedule order (may be empty: no look-ahead).
        cache_of_stage: the cache serving a stage index of this rank (``None``: no cache).
    """

    def __init__(self, steps: Sequence[Step], cache_of_stage: Callable[[int], CacheLike | None]) -> None:
        self.steps = list(steps)
        self._cache_of_stage = cache_of_stage
        self._caches: dict[int, CacheLike | None] = {}
        self._cursor = 0
        #: steps that ran but were not found in the plan (0 when the plan is right)
        self.num_unplanned = 0

    def cache_of(self, stage: int) -> CacheLike | None:
        if stage not in self._caches:
            self._caches[stage] = self._cache_of_stage(stage)
        return self._caches[stage]

    def locate(self, step: Step) -> int | None:
        """Index of ``step`` at or after the cursor (moving the cursor past it), or ``None``."""
        for index in range(self._cursor, len(self.steps)):
            if self.steps[index] == step:
                if index != self._cursor:
                    logger.debug(
                        "schedule skipped planned steps %s", self.steps[self._cursor : index]
                    )
                self._cursor = index + 1
                return index
        self.num_unplanned += 1
        if self.steps:
            logger.debug("step %s is not in this rank's plan after position %d", step, self._cursor)
        return None

    def next_for(self, index: int | None, cache: CacheLike) -> Step | None:
        """The first planned step after ``index`` that ``cache`` serves."""
        if index is None:
            return None
        for step in self.steps[index + 1 :]:
            if self.cache_of(step.stage) is cache:
                return step
        return None

    def announce(self, step: Step, cache: CacheLike | None = None) -> None:
        """Tell the cache serving ``step`` that it runs now, and what it runs next."""
        if cache is None:
            cache = self.cache_of(step.stage)
        index = self.locate(step)
        if cache is None:
            return
        announce(cache, step, self.next_for(index, cache))
