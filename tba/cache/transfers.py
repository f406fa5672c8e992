"""`Transfers`: the entry state machine and its accounting; the workers are in workers.py.

Stores and loads run on separate worker pools, FIFO each; a store worker waits while loads are
queued (loads first: backward is waiting for them). Every transition happens under one lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import torch

from tba.cache.entries import HOLDS_DATA, Entry, State
from tba.cache.profiler_ranges import LoadDone
from tba.cache.stats import CacheStats
from tba.cache.streams import StreamLayer
from tba.cache.trace import TraceRecorder
from tba.cache.workers import INLINE_MAX_BYTES, TransferWorkers
from tba.errors import TBAError
from tba.offloaders.base import Offloader

__all__ = ["Transfers"]


logger = logging.getLogger(__name__)

# Note [Batched hand-offs]: waking a store worker costs a thread switch and a GIL hand-off,
# far more than copying a small tensor. A pack queues its store and wakes the workers only
# when the queued bytes reach this many (or the tensor alone does); ``flush`` (called at every
# unit boundary and at the end of forward), backpressure, ``wait_for_stores`` and close wake
# them for whatever is queued.
_WAKE_BYTES = 1 << 20

_DEAD_POLL_S = 0.5  # how often a waiting unpack checks that the load workers are alive


class Transfers(TransferWorkers):
    """Moves entries between memory and an offloader and keeps the step's counters.

    Args:
        offloader: where bytes go; None keeps everything (the "none" baseline).
        streams: ordering primitives (see Note [Transfer ordering]).
        num_store_threads, num_load_threads: worker pool sizes.
        max_inflight_bytes: bound on bytes of queued and running stores.
        on_io_error: "raise" or "keep".
    """

    def __init__(
        self,
        offloader: Offloader | None,
        streams: StreamLayer,
        *,
        num_store_threads: int,
        num_load_threads: int,
        max_inflight_bytes: int,
        on_io_error: str,
        trace: TraceRecorder,
    ) -> None:
        self.offloader = offloader
        self._store_now = getattr(offloader, "store_now", None)
        self.trace = trace
        self.streams = streams
        self.lock = threading.RLock()  # reentrant for ``_is_owned``: Note [Releases from the collector]
        # Three conditions on the one lock, so that a finished transfer wakes only those
        # waiting for one (backpressure, wait_for_stores, an inline load of another thread),
        # never idle workers: a woken worker costs GIL hand-offs with the training thread.
        self.cond = threading.Condition(self.lock)  # a transfer finished, an error, room
        self._store_ready = threading.Condition(self.lock)  # store workers: a store or reserve
        self._load_ready = threading.Condition(self.lock)  # load workers: a load queued
        self._num_waiting = 0  # threads waiting on ``cond``
        self._num_threads = {"store": num_store_threads, "load": num_load_threads}
        self._max_inflight_bytes = max_inflight_bytes
        self._keep_on_error = on_io_error == "keep"
        self._store_q: collections.deque[Entry] = collections.deque()
        self._load_q: collections.deque[Entry] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._warned_keep = False
        self._warned_resized = False
        self.error: BaseException | None = None
        self.dead: TBAError | None = None  # Note [Dead workers]
        self.raised_this_step = False  # Note [One store error per step]
        self.inflight_bytes = 0
        self.resident_bytes = 0
        self.held_bytes = 0  # bytes the offloader holds now
        self.peak_held_bytes = 0
        self._unwoken_bytes = 0  # queued since the workers were last woken
        # Bytes of dropped entries whose store or load is still running (their worker gives
        # the space back when it finishes): part of the invariants (Note [Cache invariants]).
        self._orphan_store_bytes = 0
        self._orphan_load_bytes = 0
        self._pending_releases = 0  # tokens taken from entries, not yet given back
        self._reserve_bytes: int | None = None  # a reserve() the store worker makes when idle
        self.step = CacheStats()

    # ----------------------------------------------------------------- training thread side
    def add(self, entry: Entry) -> None:
        """A new entry holding data; queue its store if it is to be offloaded (or store it now:
        Note [Small transfers inline])."""
        inline = False
        with self.lock:
            self.resident_bytes += entry.nbytes
            if entry.offload and self.offloader is not None:
                if (
                    self._store_now is not None
                    and entry.nbytes <= INLINE_MAX_BYTES
                    and entry.device.type == "cpu"
                ):
                    entry.state = State.STORING
                    self.inflight_bytes += entry.nbytes
                    inline = True
                else:
                    if self.inflight_bytes and self.inflight_bytes + entry.nbytes > self._max_inflight_bytes:
                        self._wait_for_room(entry.nbytes)
                    entry.state = State.QUEUED
                    self.inflight_bytes += entry.nbytes
                    self._store_q.append(entry)
                    self._unwoken_bytes += entry.nbytes
                    if not self._threads:
                        self._start_workers()
                    if self._unwoken_bytes >= _WAKE_BYTES:
                        self._unwoken_bytes = 0
                        self._store_ready.notify_all()
            else:
                self.step.kept_bytes += entry.nbytes
            if self.resident_bytes > self.step.peak_resident_bytes:
                self.step.peak_resident_bytes = self.resident_bytes
        if inline:
            self._store_inline(entry)
        if self.error is not None:
            self.raise_pending()

    def flush(self) -> None:
        """Wake the workers for stores queued since they were last woken (Note [Batched
        hand-offs])."""
        if self._unwoken_bytes:
            with self.lock:
                self._unwoken_bytes = 0
                self._store_ready.notify_all()

    def _wait_for_room(self, nbytes: int) -> None:
        """Backpressure (lock held): wait until the in-flight stores leave room for
        ``nbytes``. A store error ends the wait; it is raised by the caller."""
        self._unwoken_bytes = 0
        self._store_ready.notify_all()
        start = time.perf_counter()
        while (
            self.inflight_bytes > 0
            and self.inflight_bytes + nbytes > self._max_inflight_bytes
            and self.error is None
            and self.dead is None
        ):
            self._wait_done(0.1)
        self.step.store_wait_s += time.perf_counter() - start

    def keep(self, entry: Entry, data: torch.UntypedStorage) -> None:
        """Backward will want ``entry`` soon and ``data`` is its storage: keep it in memory."""
        with self.lock:
            if entry.state is State.QUEUED:
                self._cancel_store(entry)
            elif entry.state is State.STORING:
                entry.wanted = True
            elif entry.state is State.STORED:
                entry.data = data
                entry.state = State.READY
                self.resident_bytes += entry.nbytes
                self._note_peak()

    def prefetch_many(self, entries: list[Entry]) -> None:
        """``prefetch`` each of ``entries``, in order, under one lock round trip."""
        if not entries:
            return
        with self.lock:
            for entry in entries:
                state = entry.state
                if state is State.STORED:
                    if not entry.inline:  # those load where unpacked (Note [Small transfers inline])
                        self._queue_load(entry)
                elif state is State.QUEUED:
                    self._cancel_store(entry)
                elif state is State.STORING:
                    entry.wanted = True

    def fetch(self, entry: Entry) -> tuple[torch.UntypedStorage, Any]:
        """The storage of ``entry`` for unpack, waiting for (or starting) its load.

        Returns the storage and the load event to consume (None if it was not read).
        """
        with self.lock:
            state = entry.state
            if state in HOLDS_DATA:
                if state is State.QUEUED:
                    self._cancel_store(entry)
                elif state is State.STORING:
                    entry.wanted = True
                if entry.load_done is None and not entry.reloaded:  # served from memory
                    self.step.num_forwarded += 1
                assert entry.data is not None
                return entry.data, entry.load_event
            token = None
            if state is State.STORED:
                if entry.inline:  # Note [Small transfers inline]
                    entry.state = State.LOADING
                    token = entry.token
                else:
                    self.step.num_sync_loads += 1
                    self._queue_load(entry)
            elif state is State.DROPPED:
                raise AssertionError("tba bug: unpack of a dropped entry")
            elif entry.load_done is None:  # another thread loads it inline
                while entry.state is State.LOADING:
                    self._wait_done(_DEAD_POLL_S)
            done = entry.load_done
        if token is not None:
            return self._run_load(entry, token)
        if done is None:
            return self.fetch(entry)  # the other thread's inline load finished (or failed)
        else:
            start = time.perf_counter()
            while not done.wait(_DEAD_POLL_S):
                if self.dead is not None:
                    raise self.dead
            end = time.perf_counter()
            self.trace.span("stall", start, end, entry.nbytes)
            with self.lock:
                self.step.stall_s += end - start
        with self.lock:
            if entry.error is not None:
                error, entry.error = entry.error, None
                raise error
            assert entry.data is not None, "tba bug: load finished without data"
            return entry.data, entry.load_event

    def drop(self, entry: Entry) -> None:
        """Every handle of ``entry`` died: give back its memory, queue slot or offloader space."""
        token = None
        with self.lock:
            state = entry.state
            entry.state = State.DROPPED
            if state in HOLDS_DATA:
                self.resident_bytes -= entry.nbytes
            entry.data = None
            entry.alias = None
            if state is State.QUEUED:
                self.step.num_cancelled += 1
                self.inflight_bytes -= entry.nbytes
                self._notify_done()
            elif state in (State.STORED, State.READY) and entry.token is not None:
                # (a reloaded READY entry gave its token back: Note [A reloaded entry holds no
                # offloader space] in workers.py)
                token, entry.token = entry.token, None
                self._pending_releases += 1
                self.held_bytes -= entry.nbytes
            elif state is State.STORING:  # the worker gives the token back when it finishes
                self._orphan_store_bytes += entry.nbytes
            elif state is State.LOADING:
                self._orphan_load_bytes += entry.nbytes
        if token is not None and self.offloader is not None:
            self._release(token)

    def wait_for_stores(self, timeout_s: float) -> None:
        """Block until no store is queued or running and no reserve is pending (bounded by
        ``timeout_s``).

        Raises:
            TBAError: stores are still in flight after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with self.lock:
            self._unwoken_bytes = 0
            self._store_ready.notify_all()
            while (
                (self.inflight_bytes > 0 or self._reserve_bytes is not None)
                and self.error is None
                and self.dead is None
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TBAError(
                        f"tba: {self.inflight_bytes} bytes of stores still in flight after "
                        f"{timeout_s:g} s; the offloader "
                        f"{getattr(self.offloader, 'name', None)!r} is stuck or very slow"
                    )
                self._wait_done(remaining)
        self.raise_pending()

    def reserve_later(self, nbytes: int) -> None:
        """Size the offloader for ``nbytes`` held at once (0: nothing is offloaded for now, give
        back idle buffers), on the store worker before its next store (loads go first): never
        on the autograd thread, never under a lock (pinning gigabytes or preallocating files
        takes time). A failure is raised in the training step."""
        with self.lock:
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

    def take_step(self) -> CacheStats:
        """The counters since the last call (one step), and start new ones."""
        with self.lock:
            step, self.step = self.step, CacheStats()
            self.step.peak_resident_bytes = self.resident_bytes
            self.raised_this_step = False
        step.num_steps = 1
        step.finish_rates()
        return step

    # ----------------------------------------------------------------- internals (lock held)
    @property
    def transfers_of_dropped_running(self) -> bool:
        """Whether a store, load or release of a dropped entry is still running."""
        return bool(self._orphan_store_bytes or self._orphan_load_bytes or self._pending_releases)

    def _release(self, token: Any) -> None:
        """Give ``token``'s space back (no lock held: offloaders are never called under it)."""
        assert self.offloader is not None
        try:
            self.offloader.release(token)
        finally:
            with self.lock:
                self._pending_releases -= 1

    def check(self, entries: list[Entry]) -> list[str]:
        """Invariants of a finished step, as readable problems (empty when all hold):
        counters equal what ``entries`` (the live ones) hold, nothing in flight when no entry
        is, the offloader holds exactly what the entries' tokens say."""
        with self.lock:
            problems = []
            resident = sum(e.nbytes for e in entries if e.state in HOLDS_DATA)
            inflight = self._orphan_store_bytes + sum(
                e.nbytes for e in entries if e.state in (State.QUEUED, State.STORING)
            )
            held = self._orphan_load_bytes + sum(e.nbytes for e in entries if e.token is not None)
            for name, counter, expected in (
                ("resident_bytes", self.resident_bytes, resident),
                ("inflight_bytes", self.inflight_bytes, inflight),
                ("held_bytes", self.held_bytes, held),
            ):
                if counter != expected:
                    problems.append(
                        f"{name} is {counter} but the {len(entries)} live entries account for {expected}"
                    )
            if not entries and (self._store_q and any(e.state is State.QUEUED for e in self._store_q)):
                problems.append(f"{len(self._store_q)} stores queued with no live entry")
            return problems

    def _note_peak(self) -> None:
        if self.resident_bytes > self.step.peak_resident_bytes:
            self.step.peak_resident_bytes = self.resident_bytes

    def _cancel_store(self, entry: Entry) -> None:
        entry.state = State.KEPT
        self.inflight_bytes -= entry.nbytes
        self.step.num_cancelled += 1
        self.step.kept_bytes += entry.nbytes
        self._notify_done()

    def _notify_done(self) -> None:
        """A transfer finished, room was made or an error came (lock held): wake whoever
        waits for that (``notify_all`` is Python code: skipped when nobody waits)."""
        if self._num_waiting:
            self.cond.notify_all()

    def _wait_done(self, timeout: float) -> None:
        """Wait (lock held) for ``_notify_done`` or ``timeout`` seconds."""
        self._num_waiting += 1
        try:
            self.cond.wait(timeout)
        finally:
            self._num_waiting -= 1

    def _notify_everyone(self) -> None:
        self.cond.notify_all()
        self._store_ready.notify_all()
        self._load_ready.notify_all()

    def _queue_load(self, entry: Entry) -> None:
        entry.state = State.LOADING
        entry.load_done = LoadDone(entry.scope)  # Note [Profiler ranges]: waits are stalls
        self._load_q.append(entry)
        self._start_workers()
        self._load_ready.notify()

    # ----------------------------------------------------------------- shutdown
    def close(self, entries: list[Entry]) -> None:
        """Stop the workers (a running transfer finishes first) and release every entry."""
        with self.lock:
            self._stopping = True
            self._store_q.clear()
            self._load_q.clear()
            self._notify_everyone()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for entry in entries:
            if entry.state is State.LOADING and entry.load_done is not None:
                entry.state = State.STORED
                entry.load_done.set()
            self.drop(entry)
