"""Which blocks are offloaded: the kept tail, and with ``adaptive`` the measured boundary.

The boundary rule (TBA paper, arXiv 2408.10013): with per-block forward time ``t``, offload
volume ``V``, forward time ``T_f`` and write bandwidth ``B``, walk blocks in forward order with
``P`` the blocks before ``n`` and stop at the first ``n`` where

    (sum_P V + 2 V_n) / (3 T_f - 2 sum_P t) > B

(backward taken as twice forward): blocks before ``n`` are offloaded, the rest stay in memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

__all__ = ["Boundary", "BoundaryDecision", "solve_boundary"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BoundaryDecision:
    """An adaptive decision and the measurements it came from.

    Attributes:
        tail_start: blocks ``[0, tail_start)`` are offloaded, the others kept.
        num_blocks: blocks in the model.
        block_s: forward time of each block.
        block_bytes: bytes each block would offload.
        forward_s: forward time of the whole model.
        write_bytes_per_s: write bandwidth measured from completed stores.
        reason: one line saying why.
    """

    tail_start: int
    num_blocks: int
    block_s: tuple[float, ...]
    block_bytes: tuple[int, ...]
    forward_s: float
    write_bytes_per_s: float
    reason: str


def solve_boundary(
    block_s: Sequence[float],
    block_bytes: Sequence[int],
    forward_s: float,
    write_bytes_per_s: float,
) -> tuple[int, str]:
    """The first block that must stay in memory by the boundary rule, and why.

    Returns ``(n, reason)``: offload blocks ``[0, n)``. ``n == len(block_s)`` when every
    block's writes fit.

    Example:
        >>> solve_boundary([1.0, 1.0], [10, 10], forward_s=2.0, write_bytes_per_s=100.0)[0]
        2
    """
    if len(block_s) != len(block_bytes):
        raise ValueError(f"{len(block_s)} block times but {len(block_bytes)} block volumes")
    if write_bytes_per_s <= 0:
        return 0, "no write bandwidth measured: keep every block"
    sum_v, sum_t = 0.0, 0.0
    for n, (t, v) in enumerate(zip(block_s, block_bytes)):
        window_s = 3.0 * forward_s - 2.0 * sum_t
        need = sum_v + 2.0 * v
        if window_s <= 0 or need / window_s > write_bytes_per_s:
            return n, (
                f"block {n}: {need / 2**20:.1f} MiB to write in {max(window_s, 0) * 1e3:.1f} ms "
                f"needs more than the measured {write_bytes_per_s / 2**20:.1f} MiB/s"
            )
        sum_v += v
        sum_t += t
    return len(block_s), "every block's writes fit under the compute that hides them"


class Boundary:
    """Blocks ``[0, tail_start)`` are offloaded, blocks from ``tail_start`` on stay in memory.

    Args:
        num_blocks: blocks of the model.
        keep_last_modules: how many trailing blocks always stay in memory.
    """

    def __init__(self, num_blocks: int, keep_last_modules: int) -> None:
        self.num_blocks = num_blocks
        self.keep_last_modules = keep_last_modules
        self.default_tail_start = max(0, num_blocks - keep_last_modules)
        self.tail_start = self.default_tail_start
        self.decision: BoundaryDecision | None = None

    def decide(
        self,
        block_s: Sequence[float],
        block_bytes: Sequence[int],
        forward_s: float,
        write_bytes_per_s: float,
    ) -> BoundaryDecision:
        """Move the boundary by the rule (never past the kept tail) and remember why."""
        n, reason = solve_boundary(block_s, block_bytes, forward_s, write_bytes_per_s)
        self.tail_start = min(n, self.default_tail_start)
        self.decision = BoundaryDecision(
            self.tail_start, self.num_blocks, tuple(block_s), tuple(block_bytes), forward_s,
            write_bytes_per_s, reason,
        )
        logger.info(
            "tba adaptive: offload blocks [0, %d) of %d, keep the rest (%s; forward %.1f ms, "
            "write %.2f GiB/s, %.1f MiB offloadable)",
            self.tail_start, self.num_blocks, reason, forward_s * 1e3, write_bytes_per_s / 2**30,
            sum(block_bytes) / 2**20,
        )
        return self.decision
