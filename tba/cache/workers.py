"""Where the transfer engine's (``Transfers``) copies run, and how their results and failures
are accounted: the store and load worker threads (started, run, and reported dead here), and
small CPU transfers run inline on the training thread (Note [Small transfers inline]).

``TransferWorkers`` is that side of ``Transfers``: it uses the engine's lock, queues and
counters (defined by ``Transfers``); everything here happens either under that lock or with an
offloader call outside it.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from time import thread_time  # not through ``time``: tests swap that module's clock
from typing import Any

import torch

from tba._torch_compat import release_alias, storage_bytes
from tba.cache.entries import Entry, State
from tba.cache.profiler_ranges import transfer_range
from tba.cache.streams import PAGE_BYTES
from tba.errors import OffloadIOError, TBAError
from tba.offloaders.cpu_time import TransferCPU

__all__ = ["INLINE_MAX_BYTES", "TransferWorkers"]

logger = logging.getLogger(__name__)


# Note [Small transfers inline]: a store or load handed to a worker thread costs a wake-up and,
# worse, GIL hand-offs: every torch call on either thread releases the GIL, so a running worker
# and the training thread trade it at each op (tens of microseconds per small tensor on a 2-core
# machine, measured by benchmarks/hook_overhead.py), while copying a few KiB between CPU buffers
# takes under a microsecond. A CPU storage of at most this many bytes is therefore stored on
# the training thread at pack time when the offloader can take it at once
# (``store_now(storage)`` returns a token, or None to go through the workers: no room without
# allocating, a reserve pending, a non-CPU storage), and read back by whoever unpacks it. CUDA
# storages always go through the workers (their copies wait on streams). The entry's state
# machine and counters are the same as for a worker's transfer: only the thread differs.
INLINE_MAX_BYTES = 64 << 10


class _Resized(Exception):
    """A store's source storage changed size while it was being copied."""


class TransferWorkers:
    """Transfer-running methods of ``Transfers`` (a mixin: state lives in ``Transfers``)."""

    cond: Any
    lock: Any
    _notify_done: Any
    _store_ready: Any
    _load_ready: Any
    offloader: Any
    streams: Any
    trace: Any
    step: Any
    _store_now: Any
    error: BaseException | None
    raised_this_step: bool

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

    # ----------------------------------------------------------------- threads
    def _start_workers(self) -> None:
        if self._threads:
            return
        for kind, target in (("store", self._store_worker), ("load", self._load_worker)):
            for i in range(self._num_threads[kind]):
                thread = threading.Thread(
                    target=self._run_worker, args=(target,), name=f"tba-{kind}-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _run_worker(self, target: Any) -> None:
        """Note [Dead workers]: an exception escaping a worker loop is a tba bug (offloader
        failures are caught and accounted inside it). The thread would die silently, and the
        training thread would then wait forever for room or for a load; instead every later
        hook raises a TBAError naming the worker and the cause."""
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
            name = threading.current_thread().name
            dead = TBAError(
                f"tba bug: transfer worker {name} died ({type(exc).__name__}: {exc}); the cache "
                "can no longer move tensors: close() it (training without tba is unaffected) "
                "and report this with the traceback"
            )
            dead.__cause__ = exc
            logger.error("%s", dead, exc_info=exc)
            with self.lock:
                if self.dead is None:
                    self.dead = dead
                if self.error is None:
                    self.error = dead  # the hooks' one-attribute check sees it
                self._notify_everyone()

    # ----------------------------------------------------------------- transfers
    def _store_inline(self, entry: Entry) -> None:
        """Note [Small transfers inline] (no lock held, the entry is STORING): ``store_now``,
        or the worker queue when the offloader cannot take it at once."""
        storage = entry.data
        assert storage is not None
        start, cpu_start = time.perf_counter(), thread_time()
        failure = None
        try:
            with transfer_range("store", entry):
                token = self._store_now(storage)
        except Exception as exc:  # re-raised on the training thread, never swallowed
            token, failure = None, exc
        if token is None and failure is None:
            with self.lock:  # no room now: a worker stores it, under the same backpressure
                if not entry.wanted:
                    self.inflight_bytes -= entry.nbytes
                    if self.inflight_bytes and self.inflight_bytes + entry.nbytes > self._max_inflight_bytes:
                        self._wait_for_room(entry.nbytes)
                    self.inflight_bytes += entry.nbytes
                if entry.wanted:  # backward came meanwhile (another thread's)
                    self._cancel_store(entry)
                    return
                entry.state = State.QUEUED
                self._store_q.append(entry)
                self._unwoken_bytes += entry.nbytes
                if not self._threads:
                    self._start_workers()
            return
        entry.inline = True
        cpu_s = thread_time() - cpu_start  # CacheStats.io_cpu_s: on this thread only
        self._finish_store(entry, storage, token, failure, start, time.perf_counter(), cpu_s)

    def _store_worker(self) -> None:
        assert self.offloader is not None
        while True:
            with self.lock:
                while not self._stopping and (not self._store_q or self._load_q):
                    if self._reserve_bytes is not None and not self._load_q:
                        break
                    self._store_ready.wait()
                if self._stopping:
                    return
                if self._reserve_bytes is not None and not self._load_q:
                    # Before the next step's first store: it is sized for them (and a failure
                    # to reserve surfaces at that store, in the step).
                    reserve, self._reserve_bytes = self._reserve_bytes, None
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
            self._run_store(entry, storage, event)

    def _run_store(self, entry: Entry, storage: Any, event: Any) -> None:
        """On a store worker, no lock held, the entry STORING: copy ``storage`` out."""
        assert self.offloader is not None
        start = time.perf_counter()
        src = storage_bytes(storage)
        token, failure, cpu = None, None, TransferCPU()
        try:
            with cpu, transfer_range("store", entry), self.streams.transfer(entry.device, "store", event):
                token = self.offloader.store(src)
        except Exception as exc:  # re-raised on the training thread, never swallowed
            failure = exc
        end = time.perf_counter()
        del src
        self._finish_store(entry, storage, token, failure, start, end, cpu.seconds)
        failure = None  # see _finish_store

    def _finish_store(
        self, entry: Entry, storage: Any, token: Any, failure: BaseException | None,
        start: float, end: float, cpu_s: float,
    ) -> None:
        """Account for a finished store (no lock held on entry) that took ``cpu_s`` of CPU: on
        a store worker, or on the training thread after an inline one (Note [Small transfers
        inline])."""
        elapsed = end - start
        self.trace.span("store", start, end, entry.nbytes, failure is None)
        if failure is None and storage.nbytes() != entry.nbytes:
            # Freed or resized while the copy ran: the stored bytes may be garbage. The
            # token is given back and the entry kept (as an unmanaged save would be).
            failure = _Resized()
        # Note [Reload buffers at the source's page offset]
        page_offset = storage.data_ptr() % PAGE_BYTES if storage.device.type == "cpu" else 0
        del storage
        release = None
        with self.lock:
            self.step.io_cpu_s += cpu_s
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
                if self.held_bytes > self.peak_held_bytes:
                    self.peak_held_bytes = self.held_bytes
                if entry.state is State.DROPPED:
                    release = token
                    self._pending_releases += 1
                    self.held_bytes -= entry.nbytes
                else:
                    entry.page_offset = page_offset
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
            self._notify_done()
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
            self._notify_done()  # wait_for_stores waits for this too
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
            self._notify_done()
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
        dropped = entry.state is State.DROPPED
        if not dropped:
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
        elif dropped or self.raised_this_step:
            # Note [One store error per step]: the step already failed with a store error, or
            # the tensor died before its store failed (nothing of it is lost): counted and
            # logged, not raised again in a later step (or by close()) as a stale error.
            logger.warning("tba: another store failed in a step that already failed: %s", error)
        elif self.error is None:
            self.error = error

    def _load_worker(self) -> None:
        assert self.offloader is not None
        while True:
            with self.lock:
                while not self._stopping and not self._load_q:
                    self._load_ready.wait()
                if self._stopping:
                    return
                entry = self._load_q.popleft()
                if entry.state is not State.LOADING:
                    continue
                token = entry.token
            self._run_load(entry, token)

    def _run_load(self, entry: Entry, token: Any) -> tuple[Any, Any]:
        """Read ``entry`` back (no lock held; the entry is LOADING) and account for the result:
        on a load worker, or on the thread that wants it for a small CPU entry (Note [Small
        transfers inline]). Returns what ``Transfers.fetch`` returns (the storage and its load
        event); raises the load's error (the worker ignores both: the unpack that waits gets
        them from the entry)."""
        assert self.offloader is not None
        done = entry.load_done
        start = time.perf_counter()
        dst, event, failure = None, None, None
        if entry.inline:  # CPU time on this thread only, as for inline stores
            cpu_start = thread_time()
            try:
                dst = torch.empty(entry.nbytes, dtype=torch.uint8)
                with transfer_range("load", entry):
                    self.offloader.load(token, dst)
            except Exception as exc:  # re-raised to the caller below
                failure = exc
            cpu_s = thread_time() - cpu_start
        else:
            cpu = TransferCPU()
            try:
                with cpu:
                    # Note [Reload buffers on the consumer's stream]
                    dst, ready = self.streams.allocate(entry.device, entry.nbytes, entry.event, entry.page_offset)
                    with transfer_range("load", entry), self.streams.transfer(entry.device, "load", ready):
                        self.offloader.load(token, dst)
                        event = self.streams.loaded_event(entry.device)
            except Exception as exc:  # re-raised on the training thread by fetch()
                failure = exc
            cpu_s = cpu.seconds
        end = time.perf_counter()
        elapsed = end - start
        self.trace.span("load", start, end, entry.nbytes, failure is None)
        release = error = None
        with self.lock:
            self.step.io_cpu_s += cpu_s
            if entry.state is State.DROPPED:
                self._orphan_load_bytes -= entry.nbytes
                release, entry.token = entry.token, None
                self._pending_releases += 1
                self.held_bytes -= entry.nbytes
            elif failure is not None:
                error = self._fail(entry, "load", failure)
                entry.state = State.STORED  # a later unpack may try again
                if done is not None:  # else an inline load: raised below, to who wants it
                    entry.error = error
            else:
                entry.data, entry.load_event = dst.untyped_storage(), event
                entry.reloaded = True
                entry.state = State.READY
                # Note [A reloaded entry holds no offloader space]: the entry keeps its data in
                # memory until it is dropped, so the offloaded copy is never read again: give
                # it back now, not when backward is done (the pool and the device would each
                # hold the bytes meanwhile; on CPU that is the same memory twice). Tested in
                # tests/cache/test_transfers.py::test_reloaded_entries_give_their_offloader_space_back_at_once.
                release, entry.token = entry.token, None
                self._pending_releases += 1
                self.held_bytes -= entry.nbytes
                self.resident_bytes += entry.nbytes
                self.step.reloaded_bytes += entry.nbytes
                self.step.read_s += elapsed
                self._note_peak()
            data, event = entry.data, entry.load_event
            self._notify_done()
            if self._store_q and not self._load_q:
                self._store_ready.notify_all()  # stores wait while loads are queued
        if done is not None:
            done.set()
        failure = dst = None  # see _run_store
        if release is not None:
            self._release(release)
        if error is not None and done is None:
            try:
                raise error
            finally:
                error = None
        return data, event
