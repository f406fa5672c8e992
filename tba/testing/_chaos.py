"""`ChaosOffloader`: random delays before an offloader's transfers, to find code (and tests)
that is right only when tba's workers keep up with training."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from tba.offloaders.base import Offloader, StoresNow
from tba.offloaders.wrapper import OffloaderWrapper

__all__ = ["ChaosOffloader"]

_SIDES = ("store", "load", "reserve")


class _Inline:
    """A token ``store_now`` gave (its loads run on the unpacking thread: not delayed)."""

    __slots__ = ("token",)

    def __init__(self, token: Any) -> None:
        self.token = token


class ChaosOffloader(OffloaderWrapper):
    """Wraps an offloader and sleeps a random time before each of its transfers.

    Every ``store``, ``reserve`` and ``load`` the cache runs on its worker threads first sleeps
    a random 0 to ``max_delay_s`` seconds, so transfers finish in orders and at times a fast
    machine never shows: a store still running when backward needs its tensor, loads
    overtaking each other, a reserve arriving late. Small CPU storages that the cache would
    store inline on the training thread (Note [Small transfers inline] in tba's cache) are sent
    to the workers instead, at random, a ``worker_fraction`` of the time; those stored inline
    are loaded without delay, on the thread that unpacks them. A correct cache gives
    bit-identical results whatever the delays; :func:`tba.testing.check_parity` uses this
    wrapper with ``chaos=True``.

    The delays are drawn from one seeded generator, but which thread draws which delay depends
    on thread scheduling: a run is not exactly repeatable.

    Args:
        inner: the offloader whose transfers are delayed.
        max_delay_s: the longest delay, in seconds.
        seed: seeds the delays.
        sides: which calls are delayed: any of ``"store"``, ``"load"``, ``"reserve"``.
        worker_fraction: the fraction of inline stores (``store_now``) sent to the workers.
        sleep: the function that waits (``time.sleep``; tests pass a recorder).

    Attributes:
        num_delays: delays taken so far; delayed_s: their sum, in seconds.

    Raises:
        ValueError: every invalid argument at once.

    Example:
        >>> from tba.offloaders import HostOffloader
        >>> from tba.testing import ChaosOffloader
        >>> chaos = ChaosOffloader(HostOffloader(), max_delay_s=0.01, seed=1)
        >>> chaos.name
        'chaos(host)'
        >>> cache = tba.configure_tensor_cache(model, offloader=chaos)  # doctest: +SKIP
    """

    def __init__(
        self,
        inner: Offloader,
        *,
        max_delay_s: float = 0.03,
        seed: int = 0,
        sides: Iterable[str] = _SIDES,
        worker_fraction: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        sides = tuple(sides)
        problems = []
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, (int, float)) or not (
            math.isfinite(max_delay_s) and max_delay_s >= 0
        ):
            problems.append(f"max_delay_s={max_delay_s!r}: expected a number of seconds >= 0")
        if not set(sides) <= set(_SIDES):
            problems.append(f"sides={sides!r}: expected some of {_SIDES}")
        if isinstance(worker_fraction, bool) or not isinstance(worker_fraction, (int, float)) or not (
            0 <= worker_fraction <= 1
        ):
            problems.append(f"worker_fraction={worker_fraction!r}: expected a fraction from 0 to 1")
        if problems:
            raise ValueError("invalid tba.testing.ChaosOffloader:\n" + "\n".join(f"  - {p}" for p in problems))
        super().__init__(inner, "chaos")
        self.max_delay_s = float(max_delay_s)
        self.sides = frozenset(sides)
        self.worker_fraction = float(worker_fraction)
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.num_delays = 0
        self.delayed_s = 0.0

    def _delay(self, side: str) -> None:
        if side not in self.sides:
            return
        with self._lock:
            seconds = self._rng.random() * self.max_delay_s
            self.num_delays += 1
            self.delayed_s += seconds
        self._sleep(seconds)

    def store(self, src: torch.Tensor) -> Any:
        self._delay("store")
        return self.inner.store(src)

    def _store_now(self, storage: torch.UntypedStorage) -> Any:
        with self._lock:
            to_worker = self._rng.random() < self.worker_fraction
        if to_worker:
            return None  # the cache stores it with ``store`` on a worker: delayed there
        token = cast(StoresNow, self.inner).store_now(storage)
        return None if token is None else _Inline(token)

    def load(self, token: Any, dst: torch.Tensor) -> None:
        if isinstance(token, _Inline):
            self.inner.load(token.token, dst)
            return
        self._delay("load")
        self.inner.load(token, dst)

    def release(self, token: Any) -> None:
        self.inner.release(token.token if isinstance(token, _Inline) else token)

    def reserve(self, num_bytes: int) -> None:
        self._delay("reserve")
        self.inner.reserve(num_bytes)
