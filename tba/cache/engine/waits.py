"""Waits and errors of the engine (``EngineWaits``: a mixin of ``Engine``, whose state it
uses). Every wait lets go of the engine's lock while it waits (so Ctrl-C ends it at once: Note
[Interrupt-safe bookkeeping]) and is bounded: it fails with a ``TBAError`` naming what it
waited for when the workers are dead, the engine is closed, or no transfer finished for
``timeout_s`` seconds. Errors of the workers are kept here and raised on the training thread.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from tba.cache.engine.entries import Entry, HandleRef, Transfer
from tba.cache.engine.states import State
from tba.errors import TBAError
from tba.settings import POLL_S

if TYPE_CHECKING:
    import threading

    from tba.cache.engine.table import EntryTable
    from tba.cache.observe.profiler_ranges import LoadDone
    from tba.cache.observe.stats import CacheStats
    from tba.cache.observe.trace import TraceRecorder
    from tba.offloaders.base import Offloader

__all__ = ["EngineWaits"]


S = State


class EngineWaits:
    """The waiting and error-raising methods of ``Engine``."""

    lock: threading.RLock
    cond: threading.Condition
    _store_ready: threading.Condition
    _num_waiting: int
    _max_inflight_bytes: int
    _keep_on_error: bool
    _warned_load_retry: bool
    _unwoken_bytes: int
    _reserve_bytes: int | None
    _num_reserving: int
    _load_q: collections.deque[Entry]
    _progress: int
    _start_workers: Callable[[], None]
    _load_ready: threading.Condition
    _drain_locked: Callable[[], None]
    store_batch: Callable[[], None]
    offloader: Offloader | None
    trace: TraceRecorder
    step: CacheStats
    table: EntryTable
    orphans: set[Entry]
    released: collections.deque[HandleRef | Entry]
    inflight_bytes: int
    closed: bool
    timeout_s: float
    error: BaseException | None
    dead: TBAError | None
    raised_this_step: bool

    def _wait_for_room(self, nbytes: int) -> None:
        """Backpressure (lock held, released while waiting): wait until the in-flight stores
        leave room for ``nbytes``. A store error ends the wait; it is raised by the caller."""
        self._unwoken_bytes = 0
        self._store_ready.notify_all()
        start = time.perf_counter()
        try:
            self._wait_until(
                lambda: not self.inflight_bytes or self.inflight_bytes + nbytes <= self._max_inflight_bytes,
                lambda: f"room for a store of {nbytes} bytes under max_inflight_bytes="
                f"{self._max_inflight_bytes} ({self.inflight_bytes} bytes of stores in flight)",
            )
        finally:
            self.step.store_wait_s += time.perf_counter() - start
        if self.error is not None:
            self.raise_pending()

    def _wait_for_load(self, entry: Entry, done: LoadDone) -> None:
        """Wait (no lock held) until a worker finished loading ``entry``; bounded."""
        start = time.perf_counter()
        progress, since = self._progress, time.monotonic()
        while not done.wait(POLL_S):
            self._check_alive(lambda: f"the load of {entry.nbytes} bytes")
            if self._progress != progress:
                progress, since = self._progress, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                raise TBAError(
                    f"tba: backward waited {self.timeout_s:g} s for the load of {entry.nbytes} "
                    f"bytes from the {self._offloader_name()!r} offloader and no transfer "
                    "finished meanwhile: the offloader is stuck (raise transfer_timeout_s if it "
                    "is only very slow)"
                )
        end = time.perf_counter()
        self.trace.span("stall", start, end, entry.nbytes)
        with self.lock:
            self.step.stall_s += end - start

    def _report_load_error(self, xfer: Transfer, retried: bool) -> None:
        """A load failed (lock held): raise its error with ``on_io_error="raise"`` or when it
        was already read again; with ``"keep"`` warn once and let the caller read it again."""
        error, xfer.error = xfer.error, None
        if not self._keep_on_error or retried:
            assert error is not None
            try:
                raise error
            finally:
                error = None
        if not self._warned_load_retry:
            self._warned_load_retry = True
            warnings.warn(
                f"tba: {error}; on_io_error='keep' reads the tensor again (a load that fails "
                "again is raised: the bytes are only in the offloader). Shown once.",
                RuntimeWarning,
                stacklevel=2,
            )

    # ----------------------------------------------------------------- waits and errors
    def _check_alive(self, what: Callable[[], str]) -> None:
        if self.dead is not None:
            raise self.dead
        if self.closed:
            raise TBAError(
                f"tba: the tensor cache was closed while waiting for {what()} (the cache was "
                "closed or reconfigured, or its model collected, while a graph still needed it)"
            )

    def _wait_until(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait (lock held, released while waiting) until ``ready()`` or an error; fail with a
        TBAError naming ``what()`` when the workers died, the engine closed, or no transfer
        finished for ``timeout_s`` seconds."""
        progress, since = self._progress, time.monotonic()
        while not ready() and self.error is None:
            self._check_alive(what)
            self._wait_done(POLL_S)
            if self._progress != progress:
                progress, since = self._progress, time.monotonic()
            elif time.monotonic() - since > self.timeout_s and not ready():
                raise TBAError(
                    f"tba: waited {self.timeout_s:g} s for {what()} and no transfer of the "
                    f"{self._offloader_name()!r} offloader finished meanwhile: it is stuck "
                    "(raise transfer_timeout_s if it is only very slow)"
                )

    def wait_for_stores(self, timeout_s: float) -> None:
        """Block until no store is queued or running and no reserve is pending or running
        (bounded by ``timeout_s``).

        Raises:
            TBAError: stores are still in flight after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if self.released:
                self._drain_locked()
            self.store_batch()  # Note [Small transfers in batches]
            self._unwoken_bytes = 0
            self._store_ready.notify_all()
            while self.error is None and (
                self.inflight_bytes > 0 or self._reserve_bytes is not None or self._num_reserving
            ):
                self._check_alive(lambda: "stores to finish")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TBAError(
                        f"tba: {self.inflight_bytes} bytes of stores still in flight after "
                        f"{timeout_s:g} s; the offloader {self._offloader_name()!r} is stuck "
                        "or very slow"
                    )
                self._wait_done(min(remaining, POLL_S))
        self.raise_pending()

    def wait_idle(self, timeout_s: float) -> None:
        """Block until no store, load or reserve is queued or running (bounded; for tests).

        Raises:
            TBAError: transfers are still running after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s

        def busy() -> bool:
            return bool(
                self.inflight_bytes or self._reserve_bytes is not None or self._num_reserving or self._load_q
                or self.orphans
                or any(e.state is S.LOADING for e in self.table.entries())
            )

        with self.lock:
            self.store_batch()
            self._unwoken_bytes = 0
            self._store_ready.notify_all()
            while busy() and self.dead is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TBAError(f"tba: transfers still running after {timeout_s:g} s")
                self._wait_done(min(remaining, POLL_S))

    def reserve_later(self, nbytes: int) -> None:
        """Size the offloader for ``nbytes`` held at once (0: nothing is offloaded for now, give
        idle buffers back), on the store worker before its next store (loads go first): never
        on the autograd thread, never under the lock."""
        with self.lock:
            if self.closed:
                return
            self._reserve_bytes = nbytes
            self._start_workers()
            self._store_ready.notify_all()

    def set_error(self, error: BaseException) -> None:
        """Raise ``error`` at the next hook on the training thread (unless one is pending)."""
        with self.lock:
            if self.error is None:
                self.error = error
            self._notify_done()

    def raise_pending(self) -> None:
        """Raise a store error from a worker on the calling (training) thread, once; and, on
        every call, the death of a worker (Note [Dead workers])."""
        if self.dead is not None:
            raise self.dead
        if self.error is not None:
            with self.lock:
                error, self.error = self.error, None
                self.raised_this_step = error is not None  # Note [One store error per step]
            if error is not None:
                try:
                    raise error
                finally:
                    del error  # no frame -> traceback -> frame cycle keeps the step's tensors

    def _offloader_name(self) -> str | None:
        return getattr(self.offloader, "name", None)

    def _notify_done(self) -> None:
        """A transfer finished, room was made or an error came (lock held): wake whoever
        waits for that (``notify_all`` is Python code: skipped when nobody waits)."""
        if self._num_waiting:
            self.cond.notify_all()

    def _wait_done(self, timeout: float) -> None:
        """Wait (lock held, released meanwhile) for ``_notify_done`` or ``timeout`` seconds."""
        self._num_waiting += 1
        try:
            self.cond.wait(timeout)
        finally:
            self._num_waiting -= 1

    def _notify_everyone(self) -> None:
        self.cond.notify_all()
        self._store_ready.notify_all()
        self._load_ready.notify_all()
