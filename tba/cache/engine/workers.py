"""Where the engine's copies run: the store and load worker threads (started, run, and
reported dead here), and small CPU transfers run inline on the training thread (Note [Small
transfers inline]). ``TransferWorkers`` is that side of ``Engine``: it uses the engine's lock,
queues and state machine; every state change goes through ``Engine._apply``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tba._torch_compat import release_alias, storage_bytes
from tba.cache.engine.entries import Entry, Transfer
from tba.cache.engine.states import Event, State
from tba.cache.observe.profiler_ranges import transfer_range
from tba.errors import OffloadIOError, TBAError
from tba.offloaders.cpu_time import TransferCPU
from tba.settings import DIRECT_IO_ALIGNMENT

if TYPE_CHECKING:
    from tba.cache.engine.streams import StreamLayer
    from tba.cache.observe.stats import CacheStats
    from tba.cache.observe.trace import TraceRecorder
    from tba.offloaders.base import Offloader

__all__ = ["TransferWorkers", "offloader_error"]

logger = logging.getLogger(__name__)

E, S = Event, State

# Note [Small transfers inline]: a store or load handed to a worker thread costs a wake-up and,
# worse, GIL hand-offs: every torch call on either thread releases the GIL, so a running worker
# and the training thread trade it at each op (tens of microseconds per small tensor on a 2-core
# machine, measured by benchmarks/hook_overhead.py), while copying a few KiB between CPU buffers
# takes under a microsecond. A CPU storage of at most INLINE_MAX_BYTES is therefore stored on
# the training thread, together with the other small storages of its unit (Note [Small
# transfers in batches] in batches.py), when the offloader can take them at once
# (``store_now(storage)`` returns a token, or None to go through the workers: no room without
# allocating, a reserve pending, a non-CPU storage), and read back by whoever unpacks it. CUDA
# storages always go through the workers (their copies wait on streams). Both run inside the
# engine's lock (a critical section: Note [Interrupt-safe bookkeeping]); the entry's state
# machine and counters are the same as for a worker's transfer: only the thread differs.

# Note [A reloaded entry holds no offloader space]: once a load has put an entry's bytes back in
# memory, the entry keeps them until its last handle dies, and nothing reads its offloaded copy
# again (no event leads out of RELOADED but DROP). So the load's completion gives the token back
# (``_finish_load``, worker or inline) instead of the drop after backward used it: otherwise the
# offloader (pool slab, pinned buffer, SSD extent) and memory each hold the bytes of every
# prefetched block until backward is done with it, which on CPU is the same memory twice. The
# state machine says so: RELOADED holds (resident 1, in flight 0, held 0), and the invariant
# check (Note [Cache invariants]) requires a token exactly on entries whose state holds
# offloader space. An entry made READY otherwise (a store that finished while backward wanted
# it, or a stored entry saved again by the kept tail) keeps its token until it is dropped, as
# before. Tested in tests/cache/test_engine.py::test_reloaded_entries_give_their_offloader_space_back_at_once.

# Note [Inline CPU time]: ``CacheStats.io_cpu_s`` counts the CPU the transfers take from the
# host. A worker measures its thread's CPU time around a transfer (``TransferCPU``); an inline
# transfer is a copy between host buffers on the training thread that never blocks, so the
# wall time it took (from the same ``perf_counter`` readings that time the transfer for the
# trace) is its CPU time: reading the thread's CPU clock (a system call, 1 to 2 us here) four
# times per tiny tensor cost more than the copy.



def offloader_error(offloader: Offloader, what: str, nbytes: int, exc: BaseException) -> BaseException:
    """``exc`` as the ``OffloadIOError`` raised in the training step."""
    if isinstance(exc, OffloadIOError):
        return exc
    error = OffloadIOError(
        f"{what} of {nbytes} bytes through the {offloader.name!r} offloader failed: "
        f"{type(exc).__name__}: {exc}",
        num_bytes=nbytes,
    )
    error.__cause__ = exc
    return error


class TransferWorkers:
    """Transfer-running methods of ``Engine`` (a mixin: state lives in ``Engine``)."""

    lock: threading.RLock
    cond: threading.Condition
    _store_ready: threading.Condition
    _load_ready: threading.Condition
    _store_q: collections.deque[Entry]
    _load_q: collections.deque[Entry]
    _threads: list[threading.Thread]
    _num_threads: dict[str, int]
    _stopping: bool
    _reserve_bytes: int | None
    _num_reserving: int
    _keep_on_error: bool
    timeout_s: float
    _warned_keep: bool
    _warned_resized: bool
    # An Offloader: the workers run only with one (the Engine's is None for offloader="none",
    # so a precise type would need a None check per transfer here).
    offloader: Any
    streams: StreamLayer
    trace: TraceRecorder
    step: CacheStats
    # ``offloader.store_now`` (returns a token or None), or None: the inline path checks first.
    _store_now: Any
    error: BaseException | None
    dead: TBAError | None
    raised_this_step: bool
    orphans: set[Entry]
    _apply: Callable[[Entry, Event], State]
    _notify_done: Callable[[], None]
    _notify_everyone: Callable[[], None]
    _release_token: Callable[[Transfer], None]

    # ----------------------------------------------------------------- threads
    def _start_workers(self) -> None:
        if self._threads or self._stopping:
            return
        for kind, target in (("store", self._store_worker), ("load", self._load_worker)):
            for i in range(self._num_threads[kind]):
                thread = threading.Thread(
                    target=self._run_worker, args=(target,), name=f"tba-{kind}-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _join_workers(self) -> None:
        """Wait for the workers to stop (bounded by ``timeout_s``: a stuck offloader call
        keeps its daemon thread, with a warning)."""
        deadline = time.monotonic() + self.timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                warnings.warn(
                    f"tba: transfer worker {thread.name} did not stop within {self.timeout_s:g} s "
                    f"of close(): an {self.offloader.name!r} offloader call is stuck; the thread "
                    "is left to finish on its own",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self._threads = []

    def _run_worker(self, target: Callable[[], None]) -> None:
        """Note [Dead workers]: an exception escaping a worker loop is a tba bug (offloader
        failures are caught and accounted inside it). The thread would die silently, and the
        training thread would then wait for room or for a load; instead every later hook
        raises a TBAError naming the worker and the cause."""
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

    # ----------------------------------------------------------------- stores
    def _let_go(self, entry: Entry) -> None:
        """A stored entry keeps only its version-counter alias (lock held): Note
        [Saved-version check]."""
        entry.data = None
        alias = entry.alias
        if alias is not None:
            entry.remember_geometry()
            release_alias(alias)

    def _store_worker(self) -> None:
        entry: Entry | None  # None between jobs: Note [Workers hold nothing]
        storage: torch.UntypedStorage | None
        xfer: Transfer | None
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
                    # to reserve surfaces at that store, in the step). reserve(0) is a request
                    # too (Note [A keep-everything decision holds no offloader memory]).
                    reserve, self._reserve_bytes = self._reserve_bytes, None
                    self._reserve_now(reserve)
                    continue
                entry = self._store_q.popleft()
                if entry.state is not S.QUEUED:
                    continue  # cancelled or dropped while queued
                storage, xfer = entry.data, entry.xfer
                assert storage is not None and xfer is not None
                if storage.nbytes() != entry.nbytes:
                    self._resized(entry)
                    continue
                self._apply(entry, E.START_STORE)
            self._run_store(entry, storage, xfer)
            # Note [Workers hold nothing]: a finished job's locals would keep the entry, its
            # scope and the storage alive while the worker idles.
            entry = storage = xfer = None

    def _run_store(self, entry: Entry, storage: torch.UntypedStorage, xfer: Transfer) -> None:
        """On a store worker, no lock held, the entry STORING: copy ``storage`` out."""
        start = copy_start = time.perf_counter()
        src = storage_bytes(storage)
        token, failure, cpu = None, None, TransferCPU()
        try:
            with cpu, transfer_range("store", entry), self.streams.transfer(xfer.device, "store", xfer.event):
                copy_start = time.perf_counter()  # Note [Transfer time is the copy's]
                token = self.offloader.store(src)
        except Exception as exc:  # re-raised on the training thread, never swallowed
            failure = exc
        end = time.perf_counter()
        del src
        self.trace.span("store", start, end, entry.nbytes, failure is None)
        resized = failure is None and storage.nbytes() != entry.nbytes
        # Note [Reload buffers at the source's page offset]
        page_offset = storage.data_ptr() % DIRECT_IO_ALIGNMENT if storage.device.type == "cpu" else 0
        del storage
        with self.lock:
            self.step.io_cpu_s += cpu.seconds
            if resized:
                # Freed or resized while the copy ran: the stored bytes may be garbage. The
                # token is given back and the entry kept (as an unmanaged save would be).
                xfer.token = token
                self._release_token(xfer)
                self._resized(entry)
            elif failure is not None:
                self._store_failed(entry, failure)
            else:
                # Note [Pool growth is not transfer time] (tba/offloaders/cpu_time.py)
                self.step.write_s += max(end - copy_start - cpu.pool_growth_s, 0.0)
                self.step.pool_growth_s += cpu.pool_growth_s
                xfer.token, xfer.page_offset = token, page_offset
                new = self._apply(entry, E.STORE_DONE)
                if new is S.DROPPED:
                    self.orphans.discard(entry)
                    self._release_token(xfer)
                elif new is S.STORED:
                    self._let_go(entry)
        # An exception kept in a local until the next store would keep its traceback,
        # hence the failed step's tensors, alive while the worker idles.
        failure = None

    def _reserve_now(self, nbytes: int) -> None:
        """On the store worker, lock held on entry and exit (released around the call; the
        waits for stores see ``_num_reserving`` meanwhile)."""
        self._num_reserving += 1
        self.cond.release()
        try:
            self.offloader.reserve(nbytes)
        except Exception as exc:  # raised in the training step, never swallowed
            failure: BaseException | None = exc
        else:
            failure = None
        finally:
            self.cond.acquire()
            self._num_reserving -= 1
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

    def _resized(self, entry: Entry) -> None:
        """Note [Storages freed behind tba's back] (lock held): frameworks free storages with
        ``storage.resize_(0)`` (FSDP1 flat parameters, Megatron/TE forced release); a store
        must never read such memory. The entry stays in memory as it is (what autograd would
        hold), its store is dropped, and the user is told once."""
        if self._apply(entry, E.RESIZED) is S.DROPPED:
            self.orphans.discard(entry)
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
        """A store failed (lock held): the bytes are still in memory, nothing is lost. Raised
        in the training step, or kept with a warning (``on_io_error="keep"``)."""
        error = offloader_error(self.offloader, "store", entry.nbytes, exc)
        dropped = self._apply(entry, E.STORE_FAILED) is S.DROPPED
        if dropped:
            self.orphans.discard(entry)
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

    # ----------------------------------------------------------------- loads
    def _load_worker(self) -> None:
        entry: Entry | None  # None between jobs: Note [Workers hold nothing]
        xfer: Transfer | None
        while True:
            with self.lock:
                while not self._stopping and not self._load_q:
                    self._load_ready.wait()
                if self._stopping:
                    return
                entry = self._load_q.popleft()
                if not self._load_q:
                    self._wake_stores()
                if entry.state is S.ORPHAN_LOADING:  # died while its load was queued
                    self._abandon_load(entry)
                    continue
                if entry.state is not S.LOADING:
                    continue
                xfer = entry.xfer
                assert xfer is not None
                token = xfer.token
            self._run_load(entry, xfer, token)
            entry = xfer = token = None  # Note [Workers hold nothing]

    def _abandon_load(self, entry: Entry) -> None:
        """A dropped entry's load that never ran (lock held): give its space back."""
        xfer = entry.xfer
        assert xfer is not None
        self._apply(entry, E.ABANDON)
        self.orphans.discard(entry)
        self._release_token(xfer)
        if xfer.load_done is not None:
            xfer.load_done.set()

    def _run_load(self, entry: Entry, xfer: Transfer, token: Any) -> None:
        """On a load worker, no lock held, the entry LOADING: read it back and account for the
        result; the unpack that waits finds a failure in ``xfer.error``."""
        done = xfer.load_done
        start = copy_start = time.perf_counter()
        dst, event, failure, cpu = None, None, None, TransferCPU()
        try:
            with cpu:
                # Note [Reload buffers on the consumer's stream]
                dst, ready = self.streams.allocate(xfer.device, entry.nbytes, xfer.event, xfer.page_offset)
                with transfer_range("load", entry), self.streams.transfer(xfer.device, "load", ready):
                    copy_start = time.perf_counter()  # Note [Transfer time is the copy's]
                    self.offloader.load(token, dst)
                    event = self.streams.loaded_event(xfer.device)
        except Exception as exc:  # re-raised on the training thread by fetch()
            failure = exc
        end = time.perf_counter()
        self.trace.span("load", start, end, entry.nbytes, failure is None)
        with self.lock:
            self.step.io_cpu_s += cpu.seconds
            self._finish_load(entry, xfer, dst, event, failure, end - copy_start)
        if done is not None:
            done.set()
        failure = dst = None  # see _run_store

    def _finish_load(
        self, entry: Entry, xfer: Transfer, dst: Any, event: Any, failure: BaseException | None,
        elapsed: float,
    ) -> None:
        """Account for a finished load (lock held), on a worker or inline."""
        if failure is not None:
            if self._apply(entry, E.LOAD_FAILED) is S.DROPPED:
                self.orphans.discard(entry)
                self._release_token(xfer)
            else:
                xfer.error = offloader_error(self.offloader, "load", entry.nbytes, failure)
            return
        if entry.state is S.ORPHAN_LOADING:
            self._apply(entry, E.LOAD_DONE)
            self.orphans.discard(entry)
            self._release_token(xfer)
            return
        entry.data, xfer.load_event, xfer.reloaded = dst.untyped_storage(), event, True
        self.step.read_s += elapsed
        self._apply(entry, E.LOAD_DONE)  # RELOADED: holds no offloader space
        self._release_token(xfer)  # Note [A reloaded entry holds no offloader space]

    def _wake_stores(self) -> None:
        """The load queue just emptied (lock held): wake the store worker if a store or a
        reserve waits, as they do while loads are queued. A reserve counts too: a store worker
        left asleep with a reserve pending would keep ``wait_for_stores`` waiting forever."""
        if self._store_q or self._reserve_bytes is not None:
            self._store_ready.notify_all()
