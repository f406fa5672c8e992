"""`StepClock`: how the cache times steps and blocks (wall clock on CPU, CUDA events on GPU).

Injected into the cache's steps (``tba.testing.drive_closed_loop``, with
``tba.testing.FakeStepClock``) so tests can drive the closed loop (Note [Closed loop]) with a
clock of their own instead of timing races.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["StepClock", "WallClock", "CudaEventClock", "default_clock"]


class StepClock(Protocol):
    """Marks points in time on the training thread's device and measures between two marks."""

    def mark(self) -> Any:
        """A point in time (on CUDA: an event recorded on the current stream)."""
        ...

    def seconds(self, start: Any, end: Any) -> float | None:
        """Seconds from ``start`` to ``end``, or None while ``end`` has not happened yet."""
        ...

    def wait(self, mark: Any) -> None:
        """Block until ``mark`` has happened."""
        ...


class WallClock:
    """``time.perf_counter``: the hooks run synchronously with CPU compute."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        pass


class CudaEventClock:
    """CUDA events on the current stream, read once the GPU has passed them (no sync)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float | None:
        if not end.query():
            return None
        seconds: float = start.elapsed_time(end) / 1e3
        return seconds

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()


def default_clock(cuda: bool) -> StepClock:
    return CudaEventClock() if cuda else WallClock()
