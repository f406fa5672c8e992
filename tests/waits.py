"""Polling a condition another thread or process makes true, with a bound: a test that waits
for something that never happens fails with its own message instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(condition: Callable[[], object], timeout_s: float, interval_s: float = 0.001) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (checked every ``interval_s``);
    the caller asserts it, with a message saying what never happened."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
