"""CPU time of tba's own threads, read from outside the cache (works on any tba version).

Every thread tba starts is named ``tba-...`` (the cache's store and load workers, the posix
engine's I/O pool). Their CPU clocks are read with ``pthread_getcpuclockid``: per-thread, in
nanoseconds, unaffected by other processes on a busy machine (unlike wall-clock time).
"""

from __future__ import annotations

import threading
import time

__all__ = ["tba_threads_cpu_s"]


def tba_threads_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by each live thread whose name starts with ``tba-``."""
    out = {}
    for thread in threading.enumerate():
        if thread.name.startswith("tba-") and thread.ident is not None:
            try:
                out[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # the thread ended meanwhile; not on Linux
                continue
    return out
