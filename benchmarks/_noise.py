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

__all__ = ["NOISES", "BusyBursts", "StallingOffloader", "stall_windows"]

NOISES = ("none", "busy", "stalls")

_BUSY_CHILD = r"""
import random, sys, time
rng = random.Random(int(sys.argv[1]))
while True:
    on, off = rng.uniform(0.2, 2.0), rng.uniform(0.2, 2.0)
    start = time.monotonic()
    while time.monotonic() - start < on:
        pass
    print(f"{start} {time.monotonic()}", flush=True)
    time.sleep(off)
"""


class BusyBursts:
    """A child process spinning one core in random bursts until ``stop``."""

    def __init__(self, seed: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _BUSY_CHILD, str(seed)],
                                      stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, float]]:
        """Ends the child; the (start, end) monotonic times it was busy."""
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        return [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


def stall_windows(seed: int, start: float, duration_s: float) -> list[tuple[float, float]]:
    """Seeded (start, end) windows from ``start`` over ``duration_s`` seconds."""
    rng = random.Random(seed)
    windows, t = [], start + rng.uniform(0.5, 4.0)
    while t < start + duration_s:
        on = rng.uniform(0.1, 1.0)
        windows.append((t, t + on))
        t += on + rng.uniform(0.5, 4.0)
    return windows


class StallingOffloader:
    """Wraps an offloader: a store or load that starts inside a stall window waits for its end.

    Args:
        inner: the offloader that moves the bytes.
        windows: (start, end) ``time.monotonic`` windows, sorted.
    """

    def __init__(self, inner: Any, windows: list[tuple[float, float]]) -> None:
        self.inner = inner
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
        return self.inner.store(src)

    def load(self, token: Any, dst: torch.Tensor) -> None:
        self._stall()
        self.inner.load(token, dst)

    def release(self, token: Any) -> None:
        self.inner.release(token)

    def reserve(self, num_bytes: int) -> None:
        self.inner.reserve(num_bytes)

    def close(self) -> None:
        self.inner.close()
