"""Forward-pass profile for the adaptive boundary: per-block time and offloadable bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tba.cache.observe.clock import StepClock

__all__ = ["StepProfile"]


class StepProfile:
    """Times each block's forward and the whole forward, and sums each block's offloadable
    bytes, over the forward passes of one step.

    Times come from ``clock`` (CUDA events on the current stream, read once the step is over;
    on other devices the wall clock at the hooks, which are synchronous points).
    """

    def __init__(self, num_blocks: int, clock: StepClock, waited_s: Callable[[], float]) -> None:
        self.num_blocks = num_blocks
        self._clock = clock
        # Time forward spent blocked on backpressure is not compute that hides transfers:
        # it is taken out of every span it falls in.
        self._waited_s = waited_s
        self.block_bytes = [0] * num_blocks
        self._spans: list[tuple[int | None, Any, Any, float]] = []  # (block|None, start, end, waited)
        self._open: dict[int | None, list[Any]] = {}

    def start(self, block: int | None) -> None:
        """Start timing ``block`` (None: the whole forward)."""
        self._open.setdefault(block, []).append((self._clock.mark(), self._waited_s()))

    def end(self, block: int | None) -> None:
        starts = self._open.get(block)
        if starts:
            start, waited = starts.pop()
            self._spans.append((block, start, self._clock.mark(), self._waited_s() - waited))

    def add_bytes(self, block: int, num_bytes: int) -> None:
        self.block_bytes[block] += num_bytes

    def renumber(self, new_index: list[int]) -> None:
        """The blocks were numbered again (Note [Blocks in run order]): block ``b`` is now
        ``new_index[b]``."""
        block_bytes = [0] * self.num_blocks
        for old, new in enumerate(new_index):
            block_bytes[new] = self.block_bytes[old]
        self.block_bytes = block_bytes
        self._spans = [
            (new_index[block] if block is not None else None, start, end, waited)
            for block, start, end, waited in self._spans
        ]
        self._open = {
            (new_index[block] if block is not None else None): starts
            for block, starts in self._open.items()
        }

    def finish(self) -> tuple[list[float], float]:
        """Per-block forward seconds and total forward seconds."""
        block_s = [0.0] * self.num_blocks
        forward_s = 0.0
        if self._spans:
            self._clock.wait(self._spans[-1][2])
        for block, start, end, waited in self._spans:
            seconds = max(0.0, (self._clock.seconds(start, end) or 0.0) - waited)
            if block is None:
                forward_s += seconds
            else:
                block_s[block] += seconds
        return block_s, forward_s
