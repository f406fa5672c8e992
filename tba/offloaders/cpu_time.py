"""CPU time of one transfer, including what an offloader's own threads spend on it.

The cache measures each ``store``/``load`` call with :class:`TransferCPU` on its worker thread
(``CacheStats.io_cpu_s``). ``time.thread_time()`` sees only that thread; an offloader that
hands work to threads of its own (the SSD posix engine's I/O pool) measures their CPU time
there and, back on the calling thread, adds it with :func:`charge_cpu`, so the account stays
per transfer even while several run at once.

Note [Pool growth is not transfer time]: an offloader that grows its memory pool inside a
``store`` (the host pool allocating and pinning a new slab: 0.5-0.8 s per GB on an H100 host)
reports the seconds with :func:`charge_pool_growth`. The cache takes them out of the store's
busy time (``CacheStats.write_s``, the denominator of the write bandwidth the boundary rule
reads) and counts them in ``CacheStats.pool_growth_s``; the closed loop does not time a step
that grew the pool. Counted as transfer time, one growth step read 4.82 GB/s of a 47.6 GB/s
link on the H100.
"""

from __future__ import annotations

import threading
import time

__all__ = ["TransferCPU", "charge_cpu", "charge_pool_growth"]

_local = threading.local()


class TransferCPU:
    """Context manager: ``seconds`` is this thread's CPU time inside the block plus what was
    charged to it with :func:`charge_cpu` from this thread meanwhile (also if it raised)."""

    __slots__ = ("seconds", "pool_growth_s", "_start", "_charged", "_outer")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.pool_growth_s = 0.0  # Note [Pool growth is not transfer time]
        self._start = 0.0
        self._charged = 0.0
        self._outer: TransferCPU | None = None

    def __enter__(self) -> TransferCPU:
        self._charged = 0.0
        self.pool_growth_s = 0.0
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


def charge_pool_growth(seconds: float) -> None:
    """``seconds`` of the running transfer went to growing the offloader's pool, not to
    moving bytes (Note [Pool growth is not transfer time]); does nothing outside a
    :class:`TransferCPU` block."""
    account = getattr(_local, "account", None)
    if account is not None:
        account.pool_growth_s += seconds
