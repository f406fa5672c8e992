"""`Transfers`: the entry state machine, the store and load workers, and their accounting.

Stores and loads run on separate worker pools, FIFO each; a store worker waits while loads are
queued (loads first: backward is waiting for them). Every transition happens under one lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from typing import Any

import torch

from tba._torch_compat import release_alias, storage_bytes
from tba.cache.entries import HOLDS_DATA, Entry, State
from tba.cache.profiler_ranges import LoadDone, transfer_range
from tba.cache.stats import CacheStats
from tba.cache.streams import StreamLayer
from tba.cache.trace import TraceRecorder
from tba.errors import OffloadIOError, TBAError
from tba.offloaders.base import Offloader

__all__ = ["Transfers"]


class _Resized(Exception):
    """A store's source storage changed size while it was being copied."""

logger = logging.getLogger(__name__)

_HOLDS_DATA = HOLDS_DATA
# Note [Batched hand-offs]: waking a store worker costs a thread switch and a GIL hand-off,
# far more than copying a small tensor. A pack queues its store and wakes the workers only
# when the queued bytes reach this many (or the tensor alone does); ``flush`` (called at every
# unit boundary and at the end of forward), backpressure, ``wait_for_stores`` and close wake
# them for whatever is queued.
_WAKE_BYTES = 1 << 20


class Transfers:
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
        self.trace = trace
        self.streams = streams
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
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
        self._reserve_bytes = 0  # a reserve() the store worker makes when idle
        self.step = CacheStats()

    # ----------------------------------------------------------------- training thread side
    def add(self, entry: Entry) -> None:
        """A new entry holding data; queue its store if it is to be offloaded."""
        with self.cond:
            self.resident_bytes += entry.nbytes
            if entry.offload and self.offloader is not None:
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
                    self.cond.notify_all()
            else:
                self.step.kept_bytes += entry.nbytes
            if self.resident_bytes > self.step.peak_resident_bytes:
                self.step.peak_resident_bytes = self.resident_bytes
        if self.error is not None:
            self.raise_pending()

    def flush(self) -> None:
        """Wake the workers for stores queued since they were last woken (Note [Batched
        hand-offs])."""
        if self._unwoken_bytes:
            with self.cond:
                self._unwoken_bytes = 0
                self.cond.notify_all()

    def _wait_for_room(self, nbytes: int) -> None:
        """Backpressure (lock held): wait until the in-flight stores leave room for
        ``nbytes``. A store error ends the wait; it is raised by the caller."""
        self._unwoken_bytes = 0
        self.cond.notify_all()
        start = time.perf_counter()
        while (
            self.inflight_bytes > 0
            and self.inflight_bytes + nbytes > self._max_inflight_bytes
            and self.error is None
        ):
            self.cond.wait(0.1)
        self.step.store_wait_s += time.perf_counter() - start

    def keep(self, entry: Entry, data: torch.UntypedStorage) -> None:
        """Backward will want ``entry`` soon and ``data`` is its storage: keep it in memory."""
        with self.cond:
            if entry.state is State.QUEUED:
                self._cancel_store(entry)
            elif entry.state is State.STORING:
                entry.wanted = True
            elif entry.state is State.STORED:
                entry.data = data
                entry.state = State.READY
                self.resident_bytes += entry.nbytes
                self._note_peak()

    def prefetch(self, entry: Entry) -> None:
        """Start loading ``entry`` if it is offloaded; keep it if its store has not finished."""
        with self.cond:
            if entry.state is State.STORED:
                self._queue_load(entry)
            elif entry.state is State.QUEUED:
                self._cancel_store(entry)
            elif entry.state is State.STORING:
                entry.wanted = True

    def prefetch_many(self, entries: list[Entry]) -> None:
        """``prefetch`` each of ``entries``, in order, under one lock round trip."""
        if not entries:
            return
        with self.cond:
            for entry in entries:
                state = entry.state
                if state is State.STORED:
                    self._queue_load(entry)
                elif state is State.QUEUED:
                    self._cancel_store(entry)
                elif state is State.STORING:
                    entry.wanted = True

    def fetch(self, entry: Entry) -> tuple[torch.UntypedStorage, Any]:
        """The storage of ``entry`` for unpack, waiting for (or starting) its load.

        Returns the storage and the load event to consume (None if it was not read).
        """
        with self.cond:
            state = entry.state
            if state in _HOLDS_DATA:
                if state is State.QUEUED:
                    self._cancel_store(entry)
                elif state is State.STORING:
                    entry.wanted = True
                if entry.load_done is None:  # never read back: served from memory
                    self.step.num_forwarded += 1
                assert entry.data is not None
                return entry.data, entry.load_event
            if state is State.STORED:
                self.step.num_sync_loads += 1
                self._queue_load(entry)
            elif state is State.DROPPED:
                raise AssertionError("tba bug: unpack of a dropped entry")
            done = entry.load_done
        assert done is not None
        start = time.perf_counter()
        done.wait()
        end = time.perf_counter()
        self.trace.span("stall", start, end, bytes=entry.nbytes)
        with self.cond:
            self.step.stall_s += end - start
            if entry.error is not None:
                error, entry.error = entry.error, None
                raise error
            assert entry.data is not None, "tba bug: load finished without data"
            return entry.data, entry.load_event

    def drop(self, entry: Entry) -> None:
        """Every handle of ``entry`` died: give back its memory, queue slot or offloader space."""
        token = None
        with self.cond:
            state = entry.state
            entry.state = State.DROPPED
            if state in _HOLDS_DATA:
                self.resident_bytes -= entry.nbytes
            entry.data = None
            entry.alias = None
            if state is State.QUEUED:
                self.step.num_cancelled += 1
                self.inflight_bytes -= entry.nbytes
                self.cond.notify_all()
            elif state in (State.STORED, State.READY):
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
        with self.cond:
            self._unwoken_bytes = 0
            self.cond.notify_all()
            while (self.inflight_bytes > 0 or self._reserve_bytes) and self.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TBAError(
                        f"tba: {self.inflight_bytes} bytes of stores still in flight after "
                        f"{timeout_s:g} s; the offloader "
                        f"{getattr(self.offloader, 'name', None)!r} is stuck or very slow"
                    )
                self.cond.wait(remaining)
        self.raise_pending()

    def reserve_later(self, nbytes: int) -> None:
        """Size the offloader for ``nbytes`` held at once, on the store worker before its next
        store (loads go first): never on the autograd thread, never under a lock (pinning
        gigabytes or preallocating files takes time). A failure is raised in the training
        step."""
        with self.cond:
            self._reserve_bytes = nbytes
            self._start_workers()
            self.cond.notify_all()

    def set_error(self, error: BaseException) -> None:
        """Raise ``error`` at the next hook on the training thread (unless one is pending)."""
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def raise_pending(self) -> None:
        """Raise a store error from a worker on the calling (training) thread, once."""
        if self.error is not None:
            with self.cond:
                error, self.error = self.error, None
            if error is not None:
                try:
                    raise error
                finally:
                    del error  # no frame -> traceback -> frame cycle keeps the step's tensors

    def take_step(self) -> CacheStats:
        """The counters since the last call (one step), and start new ones."""
        with self.cond:
            step, self.step = self.step, CacheStats()
            self.step.peak_resident_bytes = self.resident_bytes
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
            with self.cond:
                self._pending_releases -= 1

    def check(self, entries: list[Entry], offloader_held: int | None) -> list[str]:
        """Invariants of a finished step, as readable problems (empty when all hold):
        counters equal what ``entries`` (the live ones) hold, nothing in flight when no entry
        is, the offloader holds exactly what the entries' tokens say."""
        with self.cond:
            problems = []
            resident = sum(e.nbytes for e in entries if e.state in _HOLDS_DATA)
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
            if offloader_held is not None and offloader_held != self.held_bytes:
                problems.append(
                    f"the offloader holds {offloader_held} bytes but the cache's tokens account "
                    f"for {self.held_bytes}"
                )
            return problems

    def _note_peak(self) -> None:
        if self.resident_bytes > self.step.peak_resident_bytes:
            self.step.peak_resident_bytes = self.resident_bytes

    def _cancel_store(self, entry: Entry) -> None:
        entry.state = State.KEPT
        self.inflight_bytes -= entry.nbytes
        self.step.num_cancelled += 1
        self.step.kept_bytes += entry.nbytes
        self.cond.notify_all()

    def _queue_load(self, entry: Entry) -> None:
        entry.state = State.LOADING
        entry.load_done = LoadDone(entry.scope)  # Note [Profiler ranges]: waits are stalls
        self._load_q.append(entry)
        self._start_workers()
        self.cond.notify_all()

    def _start_workers(self) -> None:
        if self._threads:
            return
        for kind, target in (("store", self._store_worker), ("load", self._load_worker)):
            for i in range(self._num_threads[kind]):
                thread = threading.Thread(target=target, name=f"tba-{kind}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _fail(self, entry: Entry, what: str, exc: BaseException) -> BaseException:
        assert self.offloader is not None
        self.step.num_io_errors += 1
        if isinstance(exc, OffloadIOError):
            return exc
        error = OffloadIOError(
            f"{what} of {entry.nbytes} bytes through the {self.offloader.name!r} offloader "
            f"failed: {type(exc).__name__}: {exc}",
            num_bytes=entry.nbytes,
        )
        error.__cause__ = exc
        return error

    # ----------------------------------------------------------------- workers
    def _store_worker(self) -> None:
        assert self.offloader is not None
        while True:
            with self.cond:
                while not self._stopping and (not self._store_q or self._load_q):
                    if self._reserve_bytes and not self._load_q:
                        break
                    self.cond.wait()
                if self._stopping:
                    return
                if self._reserve_bytes and not self._load_q:
                    # Before the next step's first store: it is sized for them (and a failure
                    # to reserve surfaces at that store, in the step).
                    reserve, self._reserve_bytes = self._reserve_bytes, 0
                    self._reserve_now(reserve)
                    continue
                entry = self._store_q.popleft()
                if entry.state is not State.QUEUED:
                    continue  # cancelled while queued
                storage, event = entry.data, entry.event
                assert storage is not None
                if storage.nbytes() != entry.nbytes:
                    self._resized(entry)
                    continue
                entry.state = State.STORING
            src = storage_bytes(storage)
            start = time.perf_counter()
            token, failure = None, None
            try:
                with transfer_range("store", entry), self.streams.transfer(entry.device, "store", event):
                    token = self.offloader.store(src)
            except Exception as exc:  # re-raised on the training thread, never swallowed
                failure = exc
            end = time.perf_counter()
            elapsed = end - start
            self.trace.span("store", start, end, bytes=entry.nbytes, ok=failure is None)
            del src
            if failure is None and storage.nbytes() != entry.nbytes:
                # Freed or resized while the copy ran: the stored bytes may be garbage. The
                # token is given back and the entry kept (as an unmanaged save would be).
                failure = _Resized()
            del storage
            release = None
            with self.cond:
                self.inflight_bytes -= entry.nbytes
                if entry.state is State.DROPPED:
                    self._orphan_store_bytes -= entry.nbytes
                if isinstance(failure, _Resized):
                    if token is not None:
                        release = token
                        self._pending_releases += 1
                    self._resized(entry, running=True)
                elif failure is not None:
                    self._store_failed(entry, failure)
                else:
                    self.step.num_offloaded += 1
                    self.step.offloaded_bytes += entry.nbytes
                    self.step.write_s += elapsed
                    self.held_bytes += entry.nbytes
                    self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
                    if entry.state is State.DROPPED:
                        release = token
                        self._pending_releases += 1
                        self.held_bytes -= entry.nbytes
                    else:
                        alias = entry.alias
                        if entry.wanted:
                            entry.token, entry.state = token, State.READY
                        else:
                            entry.token, entry.state = token, State.STORED
                            entry.data = None
                            self.resident_bytes -= entry.nbytes
                            if alias is not None:
                                # Keep the alias: it still sees the family's version counter
                                # (Note [Saved-version check]), but no longer its memory.
                                entry.remember_geometry()
                                release_alias(alias)
                self.cond.notify_all()
            # An exception kept in a local until the next store would keep its traceback,
            # hence the failed step's tensors, alive while the worker idles.
            failure = None
            if release is not None:
                self._release(release)

    def _reserve_now(self, nbytes: int) -> None:
        """On the store worker, lock held on entry and exit (released around the call)."""
        assert self.offloader is not None
        self.cond.release()
        try:
            self.offloader.reserve(nbytes)
        except Exception as exc:  # raised in the training step, never swallowed
            failure: BaseException | None = exc
        else:
            failure = None
        finally:
            self.cond.acquire()
            self.cond.notify_all()  # wait_for_stores waits for this too
        if failure is not None:
            self.step.num_io_errors += 1
            if self.error is None:
                if isinstance(failure, OffloadIOError):
                    self.error = failure
                else:
                    error = OffloadIOError(
                        f"reserving {nbytes} bytes in the {self.offloader.name!r} offloader "
                        f"failed: {type(failure).__name__}: {failure}", num_bytes=nbytes,
                    )
                    error.__cause__ = failure
                    self.error = error

    def _resized(self, entry: Entry, running: bool = False) -> None:
        """Note [Storages freed behind tba's back] (lock held): frameworks free storages with
        ``storage.resize_(0)`` (FSDP1 flat parameters, Megatron/TE forced release); a store
        must never read such memory. The entry stays in memory as it is (what autograd would
        hold), its store is dropped, and the user is told once."""
        if not running:
            self.inflight_bytes -= entry.nbytes
            self.cond.notify_all()
        if entry.state is not State.DROPPED:
            entry.state = State.KEPT
            self.step.kept_bytes += entry.nbytes
        self.step.num_resized += 1
        if not self._warned_resized:
            self._warned_resized = True
            warnings.warn(
                f"tba: a saved storage of {entry.nbytes} bytes was resized or freed "
                "(storage.resize_) after autograd saved it; tba keeps such storages instead of "
                "offloading them (this warning is shown once)",
                RuntimeWarning,
                stacklevel=1,
            )

    def _store_failed(self, entry: Entry, exc: BaseException) -> None:
        error = self._fail(entry, "store", exc)
        if entry.state is not State.DROPPED:
            entry.state = State.KEPT  # the bytes are still in memory: nothing is lost
            self.step.kept_bytes += entry.nbytes
        if self._keep_on_error:
            if not self._warned_keep:
                self._warned_keep = True
                warnings.warn(
                    f"tba: {error}; on_io_error='keep' keeps such tensors in memory "
                    "(this warning is shown once)",
                    RuntimeWarning,
                    stacklevel=1,
                )
            logger.debug("store failed, kept in memory: %s", error)
        elif self.error is None:
            self.error = error

    def _load_worker(self) -> None:
        assert self.offloader is not None
        while True:
            with self.cond:
                while not self._stopping and not self._load_q:
                    self.cond.wait()
                if self._stopping:
                    return
                entry = self._load_q.popleft()
                if entry.state is not State.LOADING:
                    continue
                token = entry.token
            start = time.perf_counter()
            dst, event, failure = None, None, None
            try:
                # Note [Reload buffers on the consumer's stream]
                dst, ready = self.streams.allocate(entry.device, entry.nbytes, entry.event)
                with transfer_range("load", entry), self.streams.transfer(entry.device, "load", ready):
                    self.offloader.load(token, dst)
                    event = self.streams.loaded_event(entry.device)
            except Exception as exc:  # re-raised on the training thread by fetch()
                failure = exc
            end = time.perf_counter()
            elapsed = end - start
            self.trace.span("load", start, end, bytes=entry.nbytes, ok=failure is None)
            release = None
            with self.cond:
                if entry.state is State.DROPPED:
                    self._orphan_load_bytes -= entry.nbytes
                    release, entry.token = entry.token, None
                    self._pending_releases += 1
                    self.held_bytes -= entry.nbytes
                elif failure is not None:
                    entry.error = self._fail(entry, "load", failure)
                    entry.state = State.STORED  # a later unpack may try again
                else:
                    entry.data, entry.load_event = dst.untyped_storage(), event
                    entry.reloaded = True
                    entry.state = State.READY
                    self.resident_bytes += entry.nbytes
                    self.step.reloaded_bytes += entry.nbytes
                    self.step.read_s += elapsed
                    self._note_peak()
                done = entry.load_done
                self.cond.notify_all()
            assert done is not None
            done.set()
            failure = dst = None  # see the store worker
            if release is not None:
                self._release(release)

    # ----------------------------------------------------------------- shutdown
    def close(self, entries: list[Entry]) -> None:
        """Stop the workers (a running transfer finishes first) and release every entry."""
        with self.cond:
            self._stopping = True
            self._store_q.clear()
            self._load_q.clear()
            self.cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for entry in entries:
            if entry.state is State.LOADING and entry.load_done is not None:
                entry.state = State.STORED
                entry.load_done.set()
            self.drop(entry)
