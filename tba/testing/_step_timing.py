"""`drive_closed_loop`: scripted time for a cache's closed loop, for tests and extenders.

The closed loop (Note [Closed loop] in tba/cache/policy/closed_loop.py) decides from measured step
times, so a test of its decisions in a real cache needs step times it chooses: real time on a
shared machine is noise, and an assertion on it is a flaky test. :func:`drive_closed_loop`
installs, on one cache, the clock its steps are timed with (a :class:`FakeStepClock` that moves
only when the test moves it, for example from a block's forward pre-hook or an offloader that
wraps another), the function that says how much memory a keep step may use, and the loop's
periods. It is the supported seam: tests use it instead of reaching into the cache.

Example:
    >>> clock = FakeStepClock()
    >>> start = clock.mark()
    >>> clock.advance(1.5)  # e.g. from a block's forward pre-hook: each block "computes" 1.5 s
    >>> clock.seconds(start, clock.mark())
    1.5
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tba.cache.tensor_cache import TensorCache

__all__ = ["FakeStepClock", "drive_closed_loop"]


class FakeStepClock:
    """A step clock (``tba.cache.observe.clock.StepClock``) that moves only when told to.

    Thread-safe: an offloader's store and load workers may advance it too (transfers that take
    time from compute).

    Args:
        start_s: the time it shows first.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)
        self._lock = threading.Lock()

    @property
    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        if not seconds >= 0:
            raise ValueError(f"tba: FakeStepClock.advance(seconds={seconds!r}): time only moves "
                             "forward; pass seconds >= 0")
        with self._lock:
            self._now += seconds

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        pass


def drive_closed_loop(
    cache: TensorCache,
    *,
    clock: FakeStepClock | None = None,
    free_bytes: Callable[[], int] | None = None,
    keep_every: int | None = None,
    recheck_every: int | None = None,
    knee: bool | None = None,
) -> None:
    """Install scripted timing on ``cache``'s closed loop; arguments left out stay as they are.

    Args:
        cache: a cache from ``tba.configure_tensor_cache`` (or ``tba.TensorCache``).
        clock: times the cache's steps (and its profiled step's blocks) instead of the wall
            clock or CUDA events. Install it before the model's first forward: the first
            forward picks the default clock.
        free_bytes: returns the bytes a keep step (a step that keeps every block) may use now;
            the loop measures, and runs keep steps when settled, only when this covers what
            a keep step holds in addition (with a margin). Called at each such decision.
        keep_every: steady steps between runs of keep steps that refresh the keep baseline
            (default 20).
        recheck_every: steady steps between re-checks from a new profile (default 500).
        knee: whether transfers overlap compute, costing nothing up to a knee (Note
            [Predictions under a knee] in tba/cache/policy/bracket_search.py; default: on
            CUDA). ``tba.testing.GpuWorld`` passes True.

    Raises:
        ValueError: the cache has no closed loop (``adaptive=False``, ``max_step_overhead=None``,
            ``activation_budget_bytes`` or offloader ``"none"``) and ``free_bytes``,
            ``keep_every`` or ``recheck_every`` was given; the clock comes after the first
            forward; a period is not a positive int. Every problem is listed at once.

    Example:
        >>> clock = FakeStepClock()
        >>> with tba.configure_tensor_cache(model, offloader="host") as cache:  # doctest: +SKIP
        ...     drive_closed_loop(cache, clock=clock, free_bytes=lambda: 1 << 40, keep_every=4)
        ...     for block in model.blocks:  # each block computes for 1 s of the fake clock
        ...         block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
        ...     for batch in batches:
        ...         model(batch).backward()
        ...     print(cache.adaptive_decision)
    """
    steps = cache._steps
    loop = steps.loop
    problems = []
    loop_only = {"free_bytes": free_bytes, "keep_every": keep_every, "recheck_every": recheck_every,
                 "knee": knee}
    given = [name for name, value in loop_only.items() if value is not None]
    if loop is None and given:
        problems.append(
            f"{', '.join(given)} given, but this cache has no closed loop (it needs "
            "adaptive=True, max_step_overhead not None, no activation_budget_bytes and an "
            "offloader other than 'none'): drop them or configure the loop"
        )
    for name, value in (("keep_every", keep_every), ("recheck_every", recheck_every)):
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{name}={value!r}: pass a positive int (steady steps)")
    if clock is not None and steps.clock is not None and steps.clock is not clock:
        problems.append(
            "clock given after the model's first forward (its steps are already timed by "
            f"{type(steps.clock).__name__}): call drive_closed_loop before the first forward"
        )
    if problems:
        raise ValueError("tba: drive_closed_loop: " + "; ".join(problems))
    with cache._engine.lock:
        if clock is not None:
            steps.clock = clock
        if free_bytes is not None:
            steps.free_bytes = free_bytes
        if loop is not None and keep_every is not None:
            loop.keep_every = keep_every
        if loop is not None and recheck_every is not None:
            loop.recheck_every = recheck_every
        if knee is not None:
            steps.knee = knee
