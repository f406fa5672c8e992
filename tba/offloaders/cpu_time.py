"""CPU time of one transfer, including what an offloader's own threads spend on it.

The cache measures each ``store``/``load`` call with :class:`TransferCPU` on its worker thread
(``CacheStats.io_cpu_s``). ``time.thread_time()`` sees only that thread; an offloader that
hands work to threads of its own (the SSD posix engine's I/O pool) measures their CPU time
there and, back on the calling thread, adds it with :func:`charge_cpu`, so the account stays
per transfer even while several run at once.
"""

from __future__ import annotations

import threading
import time

__all__ = ["TransferCPU", "charge_cpu"]

_local = threading.local()


class TransferCPU:
    """Context manager: ``seconds`` is this thread's CPU time inside the block plus what was
    charged to it with :func:`charge_cpu` from this thread meanwhile (also if it raised)."""

    __slots__ = ("seconds", "_start", "_charged", "_outer")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        self._charged = 0.0
        self._outer: TransferCPU | None = None

    def __enter__(self) -> TransferCPU:
        self._charged = 0.0
        self._outer = getattr(_local, "account", None)
        _local.account = self
        self._start = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.thread_time() - self._start + self._charged
        _local.account = self._outer
        self._outer = None


def charge_cpu(seconds: float) -> None:
    """Add ``seconds`` of CPU time another thread spent for the transfer running on this
    thread; does nothing outside a :class:`TransferCPU` block."""
    account = getattr(_local, "account", None)
    if account is not None:
        account._charged += seconds
