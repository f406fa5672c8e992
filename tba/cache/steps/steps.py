"""`Steps`: where steps begin and end, their stats, and the adaptive profile-and-decide cycle."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tba.cache.observe.clock import StepClock, default_clock
from tba.cache.observe.stats import CacheStats, format_bytes
from tba.cache.policy.boundary import Boundary, BoundaryDecision
from tba.cache.policy.closed_loop import OverheadLoop
from tba.cache.policy.keep_memory import KEEP_MARGIN, free_memory_bytes
from tba.cache.policy.profile import StepProfile
from tba.config import TensorCacheConfig
from tba.offloaders.base import Offloader
from tba.settings import BANDWIDTH_DRIFT

__all__ = ["Steps", "tensors_in"]

logger = logging.getLogger(__name__)



class Steps:
    """Keeps the finished steps' counters and runs the adaptive cycle.

    The step tracker (tba/cache/steps/tracker.py) says where steps begin and end: ``begin_forward``
    at each forward, ``finish`` when a step ends (Note [Step boundaries]). With ``adaptive``,
    the step ``profile_step`` is profiled and the boundary decided from it; a change of input
    shapes, of forwards per step, or of the measured write bandwidth schedules a new profile;
    with ``max_step_overhead`` the rule's boundary is then checked against measured step time
    (Note [Closed loop]). With ``activation_budget_bytes`` the profiled step decides the budget
    boundary instead (Note [Budget mode]), and every later step whose measured peak exceeds the
    budget moves it. All methods run under the cache's lock.
    """

    def __init__(
        self,
        config: TensorCacheConfig,
        boundary: Boundary,
        offloader: Offloader | None,
        on_cuda: Callable[[], bool],
        waited_s: Callable[[], float],
        reserve: Callable[[int], None],
    ) -> None:
        self._config = config
        self._reserve = reserve  # asks the engine to size the offloader (off this thread)
        self._waited_s = waited_s
        self._boundary = boundary
        self._offloader = offloader
        self._on_cuda = on_cuda
        self.knee: bool | None = None  # the loop's ``knee``; None: on CUDA (drive_closed_loop sets it)
        self.last = CacheStats()
        self.total = CacheStats()
        self.history: collections.deque[tuple[int, CacheStats, int]] = collections.deque(maxlen=1000)
        self.profile: StepProfile | None = None
        self._num_done = 0
        self._budget = config.activation_budget_bytes
        self._deciding = config.adaptive or self._budget is not None
        self._warned_budget = False
        self._rule_reason = ""
        self._loop_on = False  # the loop measures since the last profile
        # Adaptive needs writes to measure: with offloader "none" there is nothing to decide.
        self._profile_due = config.profile_step if self._deciding and offloader else None
        self._signature: tuple[object, ...] | None = None
        self._num_forwards = 0  # forwards (microbatches) in the running step
        self._forwards_per_step: int | None = None
        self._reserved = False
        self._trimmed = False  # Note [A keep-everything decision holds no offloader memory]
        # Note [Closed loop]: step times from ``clock`` (``tba.testing.drive_closed_loop``
        # sets one before the first forward; the default is chosen then, once the model's
        # device is known) and free memory from ``free_bytes`` (the same seam).
        self.clock: StepClock | None = None
        self.free_bytes: Callable[[], int] | None = None  # memory a keep step may use
        self._step_start: Any = None
        self._timed: collections.deque[tuple[int, int, Any, Any, bool]] = collections.deque(maxlen=64)
        overhead = config.max_step_overhead
        self.loop = (
            OverheadLoop(overhead, can_keep=self._keep_fits)
            if config.adaptive and overhead is not None and self._budget is None and offloader
            else None
        )

    def begin_forward(self, inputs: Any, opened: bool) -> None:
        """A forward of the model starts (``opened``: it opened a step) with ``inputs`` (its
        positional and keyword arguments): profile it if due."""
        if opened:
            if self.clock is None:
                self.clock = default_clock(self._on_cuda())
            self._step_start = self.clock.mark() if self.loop is not None else None
        self._num_forwards += 1
        if self._deciding:
            self._check_signature(inputs)
        due = self._profile_due
        if self.profile is None and due is not None and self._num_done + 1 >= due:
            self._boundary.set(self._boundary.default_tail_start)
            assert self.clock is not None
            self.profile = StepProfile(self._boundary.num_blocks, self.clock, self._waited_s)
        if self.profile is not None:
            self.profile.start(None)

    def end_forward(self) -> None:
        if self.profile is not None:
            self.profile.end(None)

    def forward_abandoned(self) -> None:
        """A forward of the running step was ended by an interrupt (Note [Interrupted
        forwards]): it is no forward of the step (not counted in forwards per step), and the
        profile it ran in, short of its end, is dropped: the next forward is profiled."""
        self._num_forwards -= 1
        self.profile = None

    def drop(self, step: CacheStats) -> None:
        """The running step ended and every forward of it was interrupted (Note [Step
        boundaries]): no step. Its counters ``step`` (what it saved, moved and released) join
        the totals; it is not numbered, recorded, timed or judged."""
        step.num_steps = 0
        self.total = self.total.merged(step)
        self._num_forwards = 0
        self._step_start = None
        logger.debug("tba: a step of interrupted forwards only ended: %s", step)

    def finish(self, step: CacheStats, peak_held_bytes: int) -> CacheStats:
        """Close the running step with its counters ``step``: record them, decide or
        re-profile, size the offloader from ``peak_held_bytes`` once."""
        self.last = step
        self.total = self.total.merged(step)
        self._num_done += 1
        ran_at = self._boundary.tail_start
        self.history.append((self._num_done, step, ran_at))
        if self._step_start is not None and self.clock is not None:
            grew = step.pool_growth_s > 0  # Note [Pool growth is not transfer time]
            self._timed.append((self._num_done, ran_at, self._step_start, self.clock.mark(), grew))
            self._step_start = None
        decision = self._boundary.decision
        forwards, self._num_forwards = self._num_forwards, 0
        if forwards == 0:  # a step of backward alone (Note [Step boundaries]): not a new shape
            forwards = self._forwards_per_step or 0
        if self._forwards_per_step not in (None, forwards) and decision is not None:
            self._reprofile(f"{forwards} forwards per step instead of {self._forwards_per_step}")
        self._forwards_per_step = forwards
        if self.profile is not None:
            profile, self.profile = self.profile, None
            self._decide(profile, step)
        elif decision is not None and self._profile_due is None:
            ratio = step.write_bytes_per_s / max(decision.write_bytes_per_s, 1e-9)
            if self._budget is not None:
                # The budget needs no bandwidth; a step at another boundary writes other sizes.
                self._check_budget(decision, step, ran_at)
            elif self._loop_on:
                self._feed_loop(decision)  # step time replaces the bandwidth trigger
            elif step.write_bytes_per_s > 0 and not 1 / BANDWIDTH_DRIFT <= ratio <= BANDWIDTH_DRIFT:
                self._reprofile(f"write bandwidth moved {ratio:.2f}x")
        reserve_after = self._config.profile_step if self._deciding else 1
        peak_held = peak_held_bytes
        if not self._reserved and self._num_done >= reserve_after and self._offloader and peak_held:
            self._reserved = True
            self._reserve(peak_held)
        keeps_everything = self._keeps_everything()
        if keeps_everything and not self._trimmed:
            self._reserve(0)
        self._trimmed = keeps_everything
        logger.debug("tba step finished: %s", step)
        return step

    def _keeps_everything(self) -> bool:
        """Note [A keep-everything decision holds no offloader memory]: the policy decided to
        offload no block and is not measuring. Then ``reserve(0)`` (on the store worker) lets
        the offloader give back the buffers and pool space its profiled and measured steps
        used; they come back with the next store. Tested in
        tests/cache/test_diagnose.py::test_keep_everything_decision_gives_offloader_memory_back.
        Note [The pool stays while the loop measures]: not while the loop measures, runs its
        keep steps beside an offloading decision, or looks up (``OverheadLoop.holds_pool``):
        the next offloading step would pay the pool's growth again (on the H100, 2 s)."""
        loop = self.loop
        return (
            self._deciding and self._offloader is not None and self._profile_due is None
            and self._boundary.decision is not None and self._boundary.tail_start == 0
            and not (loop is not None and loop.holds_pool)
        )

    def _reprofile(self, why: str) -> None:
        logger.info("tba adaptive: %s, re-profiling", why)
        self._profile_due = self._num_done + 1
        self._timed.clear()

    def _feed_loop(self, decision: BoundaryDecision) -> None:
        """Note [Closed loop]: hand the loop the step times that are ready (on CUDA, those
        whose end event the GPU has passed) and apply the boundary it asks for."""
        loop, clock, timed = self.loop, self.clock, self._timed
        assert loop is not None and clock is not None
        changed = False
        while timed:
            number, ran_at, start, end, grew = timed[0]
            seconds = clock.seconds(start, end)
            if seconds is None:
                break
            timed.popleft()
            changed = True
            tail_start = loop.observe(ran_at, seconds, step=number, grew_pool=grew)
            if tail_start is None:
                self._reprofile(loop.reason)
                break
            self._boundary.set(tail_start, keep_all=True)
        if changed:
            self._boundary.decision = dataclasses.replace(
                decision, reason=f"{loop.reason}; {self._rule_reason}", **loop.decision_fields()
            )

    def _keep_fits(self, extra_bytes: int) -> bool:
        """Note [Closed loop]: whether the memory free now covers a keep step that holds
        ``extra_bytes`` more than the running step (with a margin)."""
        if self.free_bytes is None:
            self.free_bytes = functools.partial(free_memory_bytes, self._on_cuda())
        return self.free_bytes() >= KEEP_MARGIN * extra_bytes

    def _decide(self, profile: StepProfile, step: CacheStats) -> None:
        block_s, forward_s = profile.finish()
        if step.write_bytes_per_s <= 0:
            logger.debug("tba adaptive: nothing was written in the profiled step; profiling the next")
            self._profile_due = self._num_done + 1
            return
        if self._budget is not None:
            ran_at = self._boundary.default_tail_start  # the profiled step offloads them all
            decision = self._boundary.decide_budget(
                block_s, profile.block_bytes, forward_s, step.write_bytes_per_s,
                budget_bytes=self._budget, peak_bytes=step.peak_resident_bytes, measured_at=ran_at,
            )
            self._warn_if_over_budget(decision)
        else:
            decision = self._boundary.decide(
                block_s, profile.block_bytes, forward_s, step.write_bytes_per_s
            )
            loop = self.loop
            if loop is not None:
                self._rule_reason = f"rule: {decision.reason}"
                self._timed.clear()
                # What a keep step holds beyond the rule's step (and what it held then).
                extra = sum(profile.block_bytes[: decision.tail_start])
                self._loop_on = self._keep_fits(extra)
                fields: dict[str, Any] = {}
                if self._loop_on:
                    # Note [Predictions under a knee]: on CUDA transfers overlap compute.
                    loop.knee = self._on_cuda() if self.knee is None else self.knee
                    tail_start = loop.start(decision.tail_start, profile.block_bytes,
                                            step=self._num_done)
                    self._boundary.set(tail_start, keep_all=True)
                    reason = loop.reason
                    fields = loop.decision_fields()
                else:
                    assert self.free_bytes is not None
                    reason = (
                        f"closed loop not measuring: a step keeping every block would hold "
                        f"{format_bytes(extra)} more, and {format_bytes(self.free_bytes())} is free"
                    )
                    logger.warning("tba adaptive: %s; the rule's boundary stands", reason)
                self._boundary.decision = dataclasses.replace(
                    decision, reason=f"{reason}; {self._rule_reason}",
                    rule_tail_start=decision.tail_start, max_step_overhead=loop.max_overhead,
                    **fields,
                )
        self._profile_due = None
        if self._boundary.decision is not None:
            self._boundary.decision = dataclasses.replace(
                self._boundary.decision, profiled_at_step=self._num_done
            )

    def _check_budget(self, decision: BoundaryDecision, step: CacheStats, ran_at: int) -> None:
        """A step at boundary ``ran_at`` peaked above the budget: offload more, from its peak
        (never fewer blocks than ``ran_at`` + 1 until the next profile)."""
        budget = self._budget
        assert budget is not None
        if step.peak_resident_bytes <= budget or ran_at >= self._boundary.default_tail_start:
            if step.peak_resident_bytes > budget:
                self._warn_if_over_budget(dataclasses.replace(
                    decision, measured_peak_bytes=step.peak_resident_bytes,
                    estimated_peak_bytes=step.peak_resident_bytes,
                ))
            return
        logger.info(
            "tba budget: step %d peaked at %d bytes over the budget of %d with blocks [0, %d) "
            "offloaded; offloading more", self._num_done, step.peak_resident_bytes, budget, ran_at,
        )
        profiled_at = decision.profiled_at_step
        decision = self._boundary.decide_budget(
            decision.block_s, decision.block_bytes, decision.forward_s,
            decision.write_bytes_per_s, budget_bytes=budget,
            peak_bytes=step.peak_resident_bytes, measured_at=ran_at, min_tail_start=ran_at + 1,
        )
        decision = self._boundary.decision = dataclasses.replace(
            decision, profiled_at_step=profiled_at
        )
        self._warn_if_over_budget(decision)

    def _warn_if_over_budget(self, decision: BoundaryDecision) -> None:
        """Note [Budget mode]: say once, with numbers, when offloading every block it may
        does not bring the peak under the budget."""
        budget, estimate = decision.activation_budget_bytes, decision.estimated_peak_bytes
        if self._warned_budget or budget is None or estimate is None or estimate <= budget:
            return
        self._warned_budget = True
        config = self._config
        warnings.warn(
            f"tba: activation_budget_bytes={budget} ({format_bytes(budget)}) cannot be met: with "
            f"every block but the kept tail offloaded (blocks [0, {decision.tail_start}) of "
            f"{decision.num_blocks}) the step's peak of saved activations in device memory is "
            f"{estimate} bytes ({format_bytes(estimate)}), the best tba can do here. Raise the "
            f"budget, or offload more: lower keep_last_modules={config.keep_last_modules}, "
            f"max_inflight_bytes={config.max_inflight_bytes} or "
            f"min_offload_bytes={config.min_offload_bytes}. (Shown once.)",
            UserWarning,
            stacklevel=1,
        )

    def _check_signature(self, inputs: Any) -> None:
        """Re-profile when the shapes of the tensors in ``inputs`` change: positional and
        keyword arguments alike, nested in tuples, lists and dicts (``model(**batch)``)."""
        signature = tuple(_shape(t) for t in tensors_in(inputs, max_depth=6))
        if self._signature is not None and signature != self._signature and self._boundary.decision:
            self._reprofile(f"input shapes changed ({self._signature} -> {signature})")
        self._signature = signature


def _shape(tensor: torch.Tensor) -> tuple[int | None, ...]:
    """``tensor``'s shape for the input signature. Note [Ragged inputs]: a nested tensor's
    ragged dimensions read ``None``. They differ from batch to batch by design (that is what
    nested tensors are for), so they do not re-profile; its regular dimensions (the number of
    sequences, the feature width) do. Reading them needs no device sync: a strided nested
    tensor has no size at a ragged dimension (``size(d)`` raises, as ``shape`` does), a
    jagged one has a nested int there, new with each batch's offsets. Tested in
    tests/cache/test_nested.py::test_ragged_input_profiles_once."""
    if not tensor.is_nested:
        return tuple(tensor.shape)
    return tuple(_regular_size(tensor, d) for d in range(tensor.dim()))


def _regular_size(tensor: torch.Tensor, dim: int) -> int | None:
    try:
        size = tensor.size(dim)
    except RuntimeError:  # a strided nested tensor's ragged dimension
        return None
    return size if isinstance(size, int) else None  # a jagged one's is a nested int


def tensors_in(output: Any, depth: int = 0, max_depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors in a module's output or arguments (tuples, lists and mappings, ``max_depth``
    levels deep)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif depth < max_depth and isinstance(output, (tuple, list)):
        for item in output:
            yield from tensors_in(item, depth + 1, max_depth)
    elif depth < max_depth and isinstance(output, Mapping):
        for item in output.values():
            yield from tensors_in(item, depth + 1, max_depth)
