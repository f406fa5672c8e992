"""Injected noise for ``adaptive_offload.py --long``: what the closed loop must stay robust to.

- ``busy``: a child process spinning one core in random bursts (on 0.2-2 s, off 0.2-2 s,
  seeded): other work on the host, which only ever adds time, to plain and tba steps alike.
- ``stalls``: tba's offloader stalls at random (seeded windows, on 0.1-1 s, off 0.5-4 s):
  a transfer that starts in a window waits for its end, as on a device that pauses (garbage
  collection, thermal throttling, a shared link); only the tba twin sees it.

Both record when they were on (``time.monotonic`` intervals), for the timeline.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from tba.offloaders import Throttled

__all__ = ["NOISES", "BusyBursts", "StallingOffloader", "stall_windows"]

NOISES = ("none", "busy", "stalls")

_BUSY_CHILD = r"""
import random, sys, time
rng = random.Random(int(sys.argv[1]))
while True:
    on, off = rng.uniform(0.2, 2.0), rng.uniform(0.2, 2.0)
    start = time.monotonic()
    print(f"on {start}", flush=True)
    while time.monotonic() - start < on:
        pass
    print(f"off {time.monotonic()}", flush=True)
    time.sleep(off)
"""


class BusyBursts:
    """A child process spinning one core in random bursts until ``stop``."""

    def __init__(self, seed: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _BUSY_CHILD, str(seed)],
                                      stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, float]]:
        """Ends the child; the (start, end) monotonic times it was busy."""
        stopped = time.monotonic()
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        intervals, start = [], None
        for kind, when in (line.split() for line in out.splitlines()):
            if kind == "on":
                start = float(when)
            elif start is not None:
                intervals.append((start, float(when)))
                start = None
        if start is not None:  # stopped in a burst
            intervals.append((start, stopped))
        return intervals


def stall_windows(seed: int, start: float, duration_s: float) -> list[tuple[float, float]]:
    """Seeded (start, end) windows from ``start`` over ``duration_s`` seconds."""
    rng = random.Random(seed)
    windows, t = [], start + rng.uniform(0.5, 4.0)
    while t < start + duration_s:
        on = rng.uniform(0.1, 1.0)
        windows.append((t, t + on))
        t += on + rng.uniform(0.5, 4.0)
    return windows


class StallingOffloader(Throttled):
    """Wraps an offloader: a store or load that starts inside a stall window waits for its end.

    Args:
        inner: the offloader that moves the bytes.
        windows: (start, end) ``time.monotonic`` windows, sorted.
    """

    def __init__(self, inner: Any, windows: list[tuple[float, float]]) -> None:
        super().__init__(inner)  # no bandwidth cap: only the stalls
        self.name = f"stalling-{inner.name}"
        self._windows = windows
        self._lock = threading.Lock()
        self.stalled_s = 0.0

    def _stall(self) -> None:
        now = time.monotonic()
        for start, end in self._windows:
            if start <= now < end:
                time.sleep(end - now)
                with self._lock:
                    self.stalled_s += end - now
                return
            if start > now:
                return

    def store(self, src: torch.Tensor) -> Any:
        self._stall()
        return super().store(src)

    def load(self, token: Any, dst: torch.Tensor) -> None:
        self._stall()
        super().load(token, dst)
