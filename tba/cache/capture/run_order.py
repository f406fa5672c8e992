"""`RunOrder`: blocks numbered in the order they run, not the order they were declared.

Note [Blocks in run order]: a block's ``block_index`` places it for every decision that walks
blocks "in forward order": the kept tail (blocks from ``tail_start`` on, and everything that
runs after the first of them), the adaptive rule and budget mode (leading blocks first), the
profile's per-block figures. Declaration order is not run order: a dual-tower model (CLIP)
declares its text tower first and runs it last, an encoder-decoder may declare its decoder
first, a model may call its blocks in any order or one block twice. Numbered as declared, such
a model keeps the wrong tail in memory (the last declared block, and everything that runs
after it) and walks the wrong blocks first.

So the first forward of the model under tba observes the order in which blocks begin, and
blocks are numbered in that order when it ends; the observation is taken again with every
adaptive profile (a new input shape may take another path) and the profile's figures are
renumbered with the blocks. A block that runs several times in a forward is placed by its
first run. Blocks that did not run in the observed forward come first (they hold nothing and
must not take the kept tail's place), in declaration order. The first forward itself runs
with declaration order. Prefetch follows the scopes of each forward as they were saved, which
is run order already. Tested by tests/cache/test_run_order.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tba.cache.steps.scopes import Unit

if TYPE_CHECKING:
    from tba.cache.policy.profile import StepProfile

__all__ = ["RunOrder"]

logger = logging.getLogger(__name__)


class RunOrder:
    """Observes the order in which the blocks of ``units`` run and numbers them in it.

    Args:
        units: the cache's units (blocks have a ``block_index``; the others are ignored).
    """

    def __init__(self, units: list[Unit]) -> None:
        self.blocks = sorted((u for u in units if u.block_index is not None),
                             key=lambda u: u.block_index or 0)  # never None here
        self.observing = bool(self.blocks)
        self._seen: list[Unit] = []
        self._seen_ids: set[int] = set()
        self._renumbered = False  # since take_renumbered() was last called

    def take_renumbered(self) -> bool:
        """Whether the blocks were numbered again since the last call."""
        renumbered, self._renumbered = self._renumbered, False
        return renumbered

    def start(self) -> None:
        """Observe the next forward (from its beginning: called when it begins)."""
        self.observing = bool(self.blocks)
        self._seen = []
        self._seen_ids = set()

    def saw(self, unit: Unit) -> None:
        """``unit`` begins in the observed forward."""
        if unit.block_index is not None and id(unit) not in self._seen_ids:
            self._seen_ids.add(id(unit))
            self._seen.append(unit)

    def finish(self, profile: StepProfile | None) -> None:
        """The observed forward ended: number the blocks in the order they ran, and the
        figures ``profile`` (a StepProfile, or None) took so far with them. A forward in which
        no block ran leaves observing on for the next."""
        seen = self._seen
        if not seen:
            return
        self.observing = False
        self._seen, self._seen_ids = [], set()
        ran = {id(u) for u in seen}
        order = [u for u in self.blocks if id(u) not in ran] + seen
        new_index = [0] * len(order)
        for new, unit in enumerate(order):
            assert unit.block_index is not None
            new_index[unit.block_index] = new
        if order == self.blocks:
            return
        for new, unit in enumerate(order):
            unit.block_index = new
        self.blocks = order
        self._renumbered = True
        if profile is not None:
            profile.renumber(new_index)
        logger.info(
            "tba: blocks numbered in the order they run (Note [Blocks in run order]): %s",
            ", ".join(u.name for u in order),
        )
