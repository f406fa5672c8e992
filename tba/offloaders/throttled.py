"""`Throttled`: an offloader whose bandwidth is capped, for experiments and tests."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import torch

from tba.offloaders.base import Offloader
from tba.offloaders.wrapper import OffloaderWrapper

__all__ = ["Throttled"]


class _Pace:
    """A shared clock: transfers reserve back-to-back slots, so concurrent threads together
    never move more than ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, num_bytes: int, started: float) -> None:
        if not self.bytes_per_s:
            return
        with self._lock:
            begin = max(started, self._free_at)
            self._free_at = begin + num_bytes / self.bytes_per_s
            until = self._free_at
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class Throttled(OffloaderWrapper):
    """Wraps an offloader and caps its write and read bandwidth.

    Its ``name`` is ``"throttled(inner's name)"``; ``used_bytes`` and ``take_tier_stats``
    answer for the inner offloader. Stores always run on the cache's store worker (the inner
    offloader's inline ``store_now`` is not passed through: it would not be paced).

    Args:
        offloader: an :class:`Offloader`, or ``"host"`` / ``"ssd"`` to build one.
        write_bytes_per_s: cap on stores (None: uncapped).
        read_bytes_per_s: cap on loads (None: uncapped).

    Example:
        >>> slow = Throttled("host", write_bytes_per_s=2e9, read_bytes_per_s=2e9)
        >>> slow.name
        'throttled(host)'
        >>> cache = tba.configure_tensor_cache(model, offloader=slow)  # doctest: +SKIP
    """

    passes_store_now = False  # stores are paced: on the store worker, never inline

    def __init__(
        self,
        offloader: Offloader | str,
        *,
        write_bytes_per_s: float | None = None,
        read_bytes_per_s: float | None = None,
    ) -> None:
        problems = [
            f"{name}={value!r}: expected None or a positive number of bytes per second"
            for name, value in (("write_bytes_per_s", write_bytes_per_s), ("read_bytes_per_s", read_bytes_per_s))
            if value is not None and not (isinstance(value, (int, float)) and value > 0)
        ]
        if not (offloader in ("host", "ssd") or isinstance(offloader, Offloader)):
            problems.append(f"offloader={offloader!r}: expected 'host', 'ssd' or an Offloader")
        if problems:  # before an offloader is built: a refused one leaves no directory behind
            raise ValueError("invalid tba.offloaders.Throttled:\n" + "\n".join(f"  - {p}" for p in problems))
        if offloader == "host":
            from tba.offloaders.host import HostOffloader

            offloader = HostOffloader()
        elif offloader == "ssd":
            from tba.offloaders.ssd import SSDOffloader

            offloader = SSDOffloader()
        super().__init__(cast(Offloader, offloader), "throttled")  # a name was replaced above
        self._write = _Pace(write_bytes_per_s)
        self._read = _Pace(read_bytes_per_s)

    def store(self, src: torch.Tensor) -> Any:
        started = time.perf_counter()
        token = self.inner.store(src)
        self._write.wait(src.numel(), started)
        return token

    def load(self, token: Any, dst: torch.Tensor) -> None:
        started = time.perf_counter()
        self.inner.load(token, dst)
        self._read.wait(dst.numel(), started)
