"""Which blocks are offloaded: the kept tail, and with ``adaptive`` the measured boundary.

The boundary rule (TBA paper, arXiv 2408.10013): with per-block forward time ``t``, offload
volume ``V``, forward time ``T_f`` and write bandwidth ``B``, walk blocks in forward order with
``P`` the blocks before ``n`` and stop at the first ``n`` where

    (sum_P V + 2 V_n) / (3 T_f - 2 sum_P t) > B

(backward taken as twice forward): blocks before ``n`` are offloaded, the rest stay in memory.

Note [Budget mode]: with ``activation_budget_bytes`` the boundary is the fewest leading blocks
whose offloading keeps the step's peak of saved activations in device memory under the budget.
Leading blocks are the cheapest to offload: their stores have the rest of forward to finish
and their loads are needed last in backward, so prefetch has the most time to hide them (the
same order the rule above walks). The peak at another boundary is estimated from a measured
one: moving block ``b`` from offloaded to kept adds its offloadable bytes ``V_b`` to the peak
(an upper bound: kept bytes are resident from their save to their backward, which spans every
instant of the step where the peak can fall). A step whose measured peak still exceeds the
budget moves the boundary further and never back (until the next profile).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tba.cache.observe.stats import format_bytes

__all__ = ["Boundary", "BoundaryDecision", "solve_boundary", "solve_budget", "estimate_peak"]

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
        activation_budget_bytes: the budget (budget mode), or None.
        estimated_peak_bytes: budget mode: the estimated peak at ``tail_start``.
        measured_peak_bytes: budget mode: the peak the estimate started from.
        rule_tail_start: closed loop: the boundary the rule allowed (``tail_start`` is what
            the measured step times kept of it).
        keep_step_s: closed loop: median keep step time of the last boundary measured.
        offload_step_s: closed loop: median step time offloading blocks
            ``[0, measured_tail_start)``, the last boundary measured.
        max_step_overhead: closed loop: the allowed overhead over keep.
        step_overhead: closed loop: the measured overhead of the last boundary measured (the
            median of paired offload/keep step-time ratios, minus 1).
        profiled_at_step: the step number the profile was taken at.
        step_overhead_bounds: closed loop: bounds on ``step_overhead`` (infinite: too few
            pairs; Note [Bounds on the median ratio]).
        measured_tail_start: closed loop: the boundary those measurements are of.
        probe_steps: closed loop: measured steps of the running or last check.
        max_probe_steps: closed loop: the most measured steps a check takes (it settles
            within them).
        settled_at_step: closed loop: the step the last check settled at; None while it
            measures.
    """

    tail_start: int
    num_blocks: int
    block_s: tuple[float, ...]
    block_bytes: tuple[int, ...]
    forward_s: float
    write_bytes_per_s: float
    reason: str
    activation_budget_bytes: int | None = None
    estimated_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    rule_tail_start: int | None = None
    keep_step_s: float | None = None
    offload_step_s: float | None = None
    max_step_overhead: float | None = None
    profiled_at_step: int | None = None
    step_overhead: float | None = None
    step_overhead_bounds: tuple[float, float] | None = None
    measured_tail_start: int | None = None
    probe_steps: int | None = None
    max_probe_steps: int | None = None
    settled_at_step: int | None = None

    def __str__(self) -> str:
        """One readable line (``summary()`` prints it)."""
        text = (
            f"offload blocks [0, {self.tail_start}) of {self.num_blocks}: {self.reason} "
            f"(forward {self.forward_s * 1e3:.1f} ms, write "
            f"{self.write_bytes_per_s / 2**20:.1f} MiB/s, "
            f"{sum(self.block_bytes) / 2**20:.1f} MiB offloadable"
        )
        if self.activation_budget_bytes is not None:
            text += (
                f", budget {format_bytes(self.activation_budget_bytes)}, measured peak "
                f"{format_bytes(self.measured_peak_bytes or 0)}, estimated peak "
                f"{format_bytes(self.estimated_peak_bytes or 0)}"
            )
        if self.rule_tail_start is not None:
            text += f", rule allows blocks [0, {self.rule_tail_start})"
        if (
            self.keep_step_s is not None and self.offload_step_s is not None
            and self.step_overhead is not None
        ):
            text += (
                f", step keep {self.keep_step_s * 1e3:.1f} ms vs offload "
                f"{self.offload_step_s * 1e3:.1f} ms"
                + (f" at blocks [0, {self.measured_tail_start})"
                   if self.measured_tail_start is not None else "")
                + f" ({self.step_overhead:+.1%}"
                + (f", max {self.max_step_overhead:.0%})" if self.max_step_overhead is not None else ")")
            )
        if self.max_probe_steps is not None:
            text += (
                f", settled at step {self.settled_at_step}" if self.settled_at_step is not None
                else ", measuring"
            ) + f" ({self.probe_steps} of at most {self.max_probe_steps} measured steps)"
        return text + ")"


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


def estimate_peak(block_bytes: Sequence[int], peak_bytes: int, measured_at: int, tail_start: int) -> int:
    """The peak at boundary ``tail_start`` from ``peak_bytes`` measured at ``measured_at``
    (Note [Budget mode]): blocks kept there but offloaded at ``measured_at`` add their bytes,
    blocks offloaded there but kept at ``measured_at`` take theirs off.

    Example:
        >>> estimate_peak([10, 20, 30], peak_bytes=100, measured_at=3, tail_start=1)
        150
    """
    lo, hi = sorted((tail_start, measured_at))
    moved = sum(block_bytes[lo:hi])
    return peak_bytes + moved if tail_start < measured_at else peak_bytes - moved


def solve_budget(
    block_bytes: Sequence[int],
    peak_bytes: int,
    measured_at: int,
    budget_bytes: int,
    *,
    min_tail_start: int = 0,
    max_tail_start: int,
) -> tuple[int, int, str]:
    """The fewest leading blocks to offload for an estimated peak within ``budget_bytes``.

    Returns ``(n, estimated_peak_bytes, reason)``: offload blocks ``[0, n)`` with ``n`` in
    ``[min_tail_start, max_tail_start]``; ``n == max_tail_start`` with an estimate above the
    budget when even that does not meet it.

    Example:
        >>> solve_budget([10, 10, 10, 10], peak_bytes=50, measured_at=3, budget_bytes=65,
        ...              max_tail_start=3)[:2]
        (2, 60)
    """
    for n in range(min_tail_start, max_tail_start + 1):
        estimate = estimate_peak(block_bytes, peak_bytes, measured_at, n)
        if estimate <= budget_bytes:
            fewer = (
                f"; keeping block {n - 1} too: "
                + format_bytes(estimate_peak(block_bytes, peak_bytes, measured_at, n - 1))
                if n > min_tail_start else ""
            )
            return n, estimate, (
                f"activation budget {format_bytes(budget_bytes)}: the fewest leading blocks "
                f"whose estimated peak {format_bytes(estimate)} fits{fewer}"
            )
    estimate = estimate_peak(block_bytes, peak_bytes, measured_at, max_tail_start)
    return max_tail_start, estimate, (
        f"activation budget {format_bytes(budget_bytes)} cannot be met: offloading blocks "
        f"[0, {max_tail_start}) the peak is {format_bytes(estimate)}"
    )


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
        # Blocks before ``tail_start`` are offloaded; with ``keep_all`` (the closed loop's
        # keep steps and its "keep every block") nothing at all is, units outside the blocks
        # included.
        self.keep_all = False
        self.decision: BoundaryDecision | None = None

    def set(self, tail_start: int, *, keep_all: bool = False) -> None:
        """Offload blocks ``[0, tail_start)`` from the next forward on; ``keep_all`` with 0
        offloads nothing at all."""
        self.tail_start = tail_start
        self.keep_all = keep_all and tail_start == 0

    def decide_budget(
        self,
        block_s: Sequence[float],
        block_bytes: Sequence[int],
        forward_s: float,
        write_bytes_per_s: float,
        *,
        budget_bytes: int,
        peak_bytes: int,
        measured_at: int,
        min_tail_start: int = 0,
    ) -> BoundaryDecision:
        """Budget mode (Note [Budget mode]): offload the fewest leading blocks whose estimated
        peak fits ``budget_bytes``, from ``peak_bytes`` measured with blocks
        ``[0, measured_at)`` offloaded."""
        n, estimate, reason = solve_budget(
            block_bytes, peak_bytes, measured_at, budget_bytes,
            min_tail_start=min(min_tail_start, self.default_tail_start),
            max_tail_start=self.default_tail_start,
        )
        rule_n, _ = solve_boundary(block_s, block_bytes, forward_s, write_bytes_per_s)
        if n > rule_n:
            reason += (
                f"; the write bandwidth hides only blocks [0, {rule_n}): expect the step to wait "
                "on transfers"
            )
        self.set(n)
        self.decision = BoundaryDecision(
            n, self.num_blocks, tuple(block_s), tuple(block_bytes), forward_s, write_bytes_per_s,
            reason, budget_bytes, estimate, peak_bytes,
        )
        logger.info("tba budget: %s", self.decision)
        return self.decision

    def decide(
        self,
        block_s: Sequence[float],
        block_bytes: Sequence[int],
        forward_s: float,
        write_bytes_per_s: float,
    ) -> BoundaryDecision:
        """Move the boundary by the rule (never past the kept tail) and remember why."""
        n, reason = solve_boundary(block_s, block_bytes, forward_s, write_bytes_per_s)
        self.set(min(n, self.default_tail_start))
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
