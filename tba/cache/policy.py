"""Which blocks are offloaded: the kept tail (and, with ``adaptive``, the measured boundary)."""

from __future__ import annotations

__all__ = ["Boundary"]


class Boundary:
    """Blocks ``[0, tail_start)`` are offloaded, blocks from ``tail_start`` on stay in memory.

    Args:
        num_blocks: blocks of the model.
        keep_last_modules: how many trailing blocks always stay in memory.
    """

    def __init__(self, num_blocks: int, keep_last_modules: int) -> None:
        self.num_blocks = num_blocks
        self.keep_last_modules = keep_last_modules
        self.tail_start = max(0, num_blocks - keep_last_modules)
