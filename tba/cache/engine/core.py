"""`Engine`: the one owner of entry life: identity, references, state, transfers, counters.

Note [One owner of entry life]: every entry is created, moved between states, counted and
dropped here, under one lock (``Engine.lock``, a critical section for signal handlers: Note
[Interrupt-safe bookkeeping]), through the transition table of Note [Entry state machine].
The training thread calls ``save`` (pack), ``fetch`` and ``prefetch`` (unpack, backward),
``drain`` (the releases of dead handles, queued by their weak references and done here in
batches) and ``flush``; the workers (workers.py) run the stores and loads and report back
through ``_apply``. No offloader call made on the training thread runs outside the lock, so a
Ctrl-C cannot split an offloader's own bookkeeping either; worker threads never get a
``KeyboardInterrupt``.

Waits and errors are in waits.py, the counters handed to the step and the invariant check in
accounting.py, the workers' side in workers.py.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from tba.cache.engine import interrupts
from tba.cache.engine.accounting import EngineAccounting
from tba.cache.engine.batches import Batch, InlineBatches
from tba.cache.engine.entries import (
    Entry, Handle, HandleRef, SavedRecord, SavedScope, Transfer, new_entry,
)
from tba.cache.engine.states import DROP_KEPT_ROW, HOLDS_DATA, KEEP_ROW, ROWS, Event, State
from tba.cache.engine.streams import StreamLayer
from tba.cache.engine.table import FAMILY_ATTR, STAMP_ATTR, EntryTable, next_stamp
from tba.cache.engine.waits import EngineWaits
from tba.cache.engine.workers import TransferWorkers
from tba.cache.observe.profiler_ranges import LoadDone
from tba.cache.observe.stats import CacheStats
from tba.cache.observe.trace import TraceRecorder
from tba.errors import TBAError
from tba.offloaders.base import Offloader
from tba.settings import INLINE_MAX_BYTES, WAKE_BYTES

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

# Note [Batched hand-offs]: waking a store worker costs a thread switch and a GIL hand-off,
# far more than copying a small tensor. A save queues its store and wakes the workers only
# when the queued bytes reach this many (or the tensor alone does); ``flush`` (called at every
# unit boundary and at the end of forward), backpressure, ``wait_for_stores`` and close wake
# them for whatever is queued (tba.settings.WAKE_BYTES).


E, S = Event, State
_LOAD_ENDS = frozenset((E.LOAD_DONE, E.LOAD_FAILED, E.ABANDON))
_KEPT, _DROPPED = KEEP_ROW[0], DROP_KEPT_ROW[0]


class Engine(EngineWaits, EngineAccounting, TransferWorkers, InlineBatches):
    """Entries of one cache: who saved what, where its bytes are, and the step's counters.

    Args:
        offloader: where bytes go; None keeps everything (the "none" baseline).
        streams: ordering primitives (see Note [Transfer ordering]).
        num_store_threads, num_load_threads: worker pool sizes.
        max_inflight_bytes: bound on bytes of queued and running stores.
        min_offload_bytes: smaller storages are never offloaded.
        on_io_error: "raise" or "keep".
        timeout_s: longest wait for a transfer to make progress.
        trace: the Chrome-trace recorder.
    """

    def __init__(
        self,
        offloader: Offloader | None,
        streams: StreamLayer,
        *,
        num_store_threads: int,
        num_load_threads: int,
        max_inflight_bytes: int,
        min_offload_bytes: int,
        on_io_error: str,
        timeout_s: float,
        trace: TraceRecorder,
    ) -> None:
        self.offloader = offloader
        self._store_now = getattr(offloader, "store_now", None)
        self.streams = streams
        self.trace = trace
        self.lock = threading.RLock()
        interrupts.guard(self.lock)
        # Three conditions on the one lock, so that a finished transfer wakes only those
        # waiting for one (backpressure, wait_for_stores, a load), never idle workers.
        self.cond = threading.Condition(self.lock)  # a transfer finished, an error, room
        self._store_ready = threading.Condition(self.lock)  # store workers: a store or reserve
        self._load_ready = threading.Condition(self.lock)  # load workers: a load queued
        self._num_waiting = 0
        self._num_threads = {"store": num_store_threads, "load": num_load_threads}
        self._max_inflight_bytes = max_inflight_bytes
        self.min_offload_bytes = min_offload_bytes
        self._keep_on_error = on_io_error == "keep"
        self.timeout_s = timeout_s
        self.table = EntryTable()
        # References of dead handles (HandleRefs, and entries: Note [One object per new entry]):
        # appended by their weakref callback, drained under the lock.
        self.released: collections.deque[HandleRef | Entry] = collections.deque()
        self._queue_release = self.released.append
        self.on_records_dead: Callable[[list[SavedRecord]], None] = lambda records: None
        self._store_q: collections.deque[Entry] = collections.deque()
        self._init_batches()
        self._load_q: collections.deque[Entry] = collections.deque()
        self._threads: list[threading.Thread] = []
        self.orphans: set[Entry] = set()  # dropped while a worker copies them
        self.closed = False
        self._stopping = False
        self._warned_keep = False
        self._warned_resized = False
        self._warned_load_retry = False
        self.error: BaseException | None = None
        self.dead: TBAError | None = None  # Note [Dead workers]
        self.raised_this_step = False  # Note [One store error per step]
        self.resident_bytes = 0
        self.inflight_bytes = 0
        self.held_bytes = 0  # bytes the offloader holds now
        self.peak_held_bytes = 0
        self._unwoken_bytes = 0  # queued since the workers were last woken
        # A reserve() the store worker makes when idle; None: none pending (0 is a request:
        # Note [A keep-everything decision holds no offloader memory] in tba/cache/steps/steps.py).
        self._reserve_bytes: int | None = None
        self._num_reserving = 0  # reserves running on store workers (lock let go)
        self._progress = 0  # transfers finished: waits fail only when this stops moving
        self.step = CacheStats()

    # ----------------------------------------------------------------- the state machine
    def _apply(self, entry: Entry, event: Event) -> State:
        """Move ``entry`` by ``event`` (lock held): Note [Entry state machine]."""
        old = entry.state
        row = ROWS.get((old, event))
        if row is None:
            raise AssertionError(f"tba bug: event {event.value!r} on a {old} entry")
        new, dr, di, dh, stats = row
        n = entry.nbytes
        entry.state = new
        step = self.step
        if dr:
            resident = self.resident_bytes = self.resident_bytes + n * dr
            if resident > step.peak_resident_bytes:
                step.peak_resident_bytes = resident
        if di:
            self.inflight_bytes += n * di
        if dh:
            held = self.held_bytes = self.held_bytes + n * dh
            if held > self.peak_held_bytes:
                self.peak_held_bytes = held
        for name, per_byte in stats:
            setattr(step, name, getattr(step, name) + (n if per_byte else 1))
        if di < 0 or event in _LOAD_ENDS:  # a transfer finished
            self._progress += 1
            self._notify_done()
        return new

    # ----------------------------------------------------------------- pack
    def save(
        self,
        tensor: torch.Tensor,
        storage: torch.UntypedStorage,
        root: torch.Tensor,
        scope: SavedScope,
        record: SavedRecord,
        offload: bool,
    ) -> Handle:
        """A handle for ``tensor`` (a plain strided tensor on ``storage``, ``root`` the base of
        its view family, saved into ``scope`` of ``record``): of an existing entry of the same
        storage, family and version, or of a new one (then ``handle.entry() is handle``: an
        entry is the weak reference of its first handle), offloaded if ``offload`` and the
        storage is at least ``min_offload_bytes``."""
        # Note [Storage stamps]: the stamps are set outside the lock (a stamp is unique however
        # many threads draw one; setting the same object's twice would only waste one).
        stamp = getattr(storage, STAMP_ATTR, None)
        seen = stamp is not None  # else no entry can be of this storage
        if stamp is None:
            stamp = next_stamp()
            setattr(storage, STAMP_ATTR, stamp)
        family = getattr(root, FAMILY_ATTR, None)
        if family is None:
            family = next_stamp()
            setattr(root, FAMILY_ATTR, family)
        table = self.table
        handle = Handle()
        handle.scope = scope
        entry: Entry | None
        with self.lock:
            if self.released:
                self._drain_locked()
            if self.closed:
                raise TBAError("tba: a save reached a closed tensor cache")
            while True:
                entry, other_family = None, False
                if seen and stamp in table.by_stamp:
                    entry, other_family = table.find(stamp, family, tensor._version)
                if entry is not None:
                    self._saved_again(entry, handle, tensor, storage, scope, record)
                    entry = None
                    break
                nbytes = storage.nbytes()
                if not offload or self.offloader is None or nbytes < self.min_offload_bytes:
                    # The KEEP row (Note [Entry state machine]), inline: the hot path.
                    entry = new_entry(handle, self._queue_release, stamp, family, tensor, storage,
                                      nbytes, scope, record)
                    entry.state = _KEPT
                    resident = self.resident_bytes = self.resident_bytes + nbytes
                    step = self.step
                    step.kept_bytes += nbytes
                    if resident > step.peak_resident_bytes:
                        step.peak_resident_bytes = resident
                    break
                if self.inflight_bytes and self.inflight_bytes + nbytes > self._max_inflight_bytes:
                    if self._batch:
                        self.store_batch()  # what waits in the batch counts as in flight
                    else:
                        self._wait_for_room(nbytes)  # lets go of the lock: look again after it
                    continue
                device = storage.device
                # Note [Small transfers in batches]
                batched = self._store_now is not None and nbytes <= INLINE_MAX_BYTES and device.type == "cpu"
                event = None if batched else self.streams.producer_event(device)
                # From here to the end of the section nothing lets go of the lock.
                entry = new_entry(handle, self._queue_release, stamp, family, tensor, storage,
                                  nbytes, scope, record)
                xfer = entry.xfer = Transfer(device, event)
                record.offloads = True
                scope.entries.append(entry)  # what backward prefetches, in save order
                if batched:
                    xfer.inline = True
                    self._add_to_batch(entry)
                else:
                    self._queue_store(entry)
                break
            if entry is not None:
                table.insert(entry)
                if other_family:
                    table.num_family_entries += 1
                record.num_handles += 1
            table.num_packed += 1
        if self.error is not None:
            self.raise_pending()
        return handle

    def _saved_again(
        self, entry: Entry, handle: Handle, tensor: torch.Tensor, storage: torch.UntypedStorage,
        scope: SavedScope, record: SavedRecord,
    ) -> None:
        """``handle`` of ``tensor`` (on ``storage``) is another handle of ``entry`` (lock held).
        The kept tail saving an offloaded entry again keeps its bytes in memory: backward will
        want it soon and ``storage`` has them."""
        handle.entry = entry
        if entry.xfer is None:  # kept from the start: its own alias (shares the storage)
            handle.view = tensor.detach()
        else:
            handle.view = (tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())
        ref = HandleRef(handle, self._queue_release)
        ref.entry, ref.record = entry, record
        others = entry.others
        if others is None:
            entry.others = [ref]
        else:
            others.append(ref)
        entry.num_handles += 1
        record.num_handles += 1
        self.table.num_deduplicated += 1
        if entry.xfer is None:
            return
        entries = scope.entries  # what backward prefetches, in save order
        if not entries or entries[-1] is not entry:
            entries.append(entry)
        if not scope.keep:
            return
        state = entry.state
        if state is S.QUEUED:
            self._cancel_queued(entry, E.CANCEL)
        elif state is S.STORING:
            self._apply(entry, E.WANT)
        elif state is S.STORED:
            entry.data = storage
            self._apply(entry, E.SAVED_AGAIN)

    def _cancel_queued(self, entry: Entry, event: Event) -> State:
        """``event`` (WANT, CANCEL, DROP or RESIZED) on a QUEUED entry (lock held): out of the
        pending batch if it waits there (Note [Small transfers in batches])."""
        xfer = entry.xfer
        if xfer is not None and xfer.inline:
            self._leave_batch(entry)
        return self._apply(entry, event)

    def _queue_store(self, entry: Entry) -> None:
        """Hand a new entry's store to the workers (lock held)."""
        self._apply(entry, E.QUEUE)
        self._store_q.append(entry)
        self._unwoken_bytes += entry.nbytes
        if not self._threads:
            self._start_workers()
        if self._unwoken_bytes >= WAKE_BYTES:
            self._unwoken_bytes = 0
            self._store_ready.notify_all()

    def flush(self) -> None:
        """Store the pending batch (Note [Small transfers in batches]), wake the workers for
        stores queued since they were last woken (Note [Batched hand-offs]) and do the queued
        releases."""
        if self._unwoken_bytes or self.released or self._batch:
            with self.lock:
                if self.released:
                    self._drain_locked()
                if self._batch:
                    self.store_batch()
                if self._unwoken_bytes:
                    self._unwoken_bytes = 0
                    self._store_ready.notify_all()

    # ----------------------------------------------------------------- unpack and backward
    def fetch(self, entry: Entry, retried: bool = False) -> tuple[torch.UntypedStorage, Any]:
        """The storage of an offloaded ``entry`` for unpack, waiting for (or starting) its
        load. Returns the storage and the load event to consume (None if it was not read).

        A failed load (this unpack's, or a prefetch's) is raised with ``on_io_error="raise"``;
        with ``"keep"`` it is read once more (warned once), and a second failure is raised."""
        with self.lock:
            if self.released:
                self._drain_locked()
            xfer = entry.xfer
            assert xfer is not None
            state = entry.state
            if xfer.error is not None:
                self._report_load_error(xfer, retried)
                retried = True
                state = entry.state
            if state in HOLDS_DATA:
                if state is S.QUEUED:
                    self._cancel_queued(entry, E.WANT)
                elif state is S.STORING:
                    self._apply(entry, E.WANT)
                if xfer.load_done is None and not xfer.reloaded:  # served from memory
                    self.step.num_forwarded += 1
                assert entry.data is not None
                return entry.data, xfer.load_event
            if state is S.STORED:
                if xfer.inline:  # Note [Small transfers in batches]
                    return self._load_batched(entry, xfer)
                self.step.num_sync_loads += 1
                self._queue_load(entry, xfer)
            elif state is not S.LOADING:
                raise AssertionError(f"tba bug: unpack of a {state} entry")
            done = xfer.load_done
            assert done is not None  # set by _queue_load
        self._wait_for_load(entry, done)
        with self.lock:
            if xfer.error is not None:
                self._report_load_error(xfer, retried)
        if entry.state is S.STORED:
            return self.fetch(entry, retried=True)
        with self.lock:
            assert entry.data is not None, "tba bug: load finished without data"
            return entry.data, xfer.load_event

    def prefetch(self, entries: list[Entry]) -> None:
        """Start loading ``entries``, in order (backward will need them in this order)."""
        if not entries:
            return
        with self.lock:
            for entry in entries:
                xfer = entry.xfer
                if xfer is None:
                    continue
                state = entry.state
                if state is S.STORED:
                    if not xfer.inline:  # loaded where unpacked (Note [Small transfers in batches])
                        self._queue_load(entry, xfer)
                elif state is S.QUEUED:
                    self._cancel_queued(entry, E.WANT)
                elif state is S.STORING:
                    self._apply(entry, E.WANT)

    def _queue_load(self, entry: Entry, xfer: Transfer) -> None:
        self._apply(entry, E.LOAD)
        xfer.load_done = LoadDone(entry.scope)  # Note [Profiler ranges]: waits are stalls
        self._load_q.append(entry)
        self._start_workers()
        self._load_ready.notify()

    # ----------------------------------------------------------------- releases
    def drain(self) -> None:
        """Do the queued releases (Note [Interrupt-safe bookkeeping])."""
        if self.released:
            with self.lock:
                self._drain_locked()

    def _drain_locked(self) -> None:
        released = self.released
        dead: list[SavedRecord] = []
        while released:
            ref = released.popleft()
            # Note [One object per new entry]: an entry is the reference of its first handle.
            if type(ref) is HandleRef:
                entry = ref.entry
                others = entry.others
                assert others is not None
                others.remove(ref)
            else:
                entry = ref  # type: ignore[assignment]  # the only other kind
            record = ref.record
            record.num_handles -= 1
            if not record.num_handles and record.forward_done:
                dead.append(record)
            entry.num_handles -= 1
            if not entry.num_handles:
                if entry.state is _KEPT and entry.xfer is None:
                    # The DROP row of a kept entry (Note [Entry state machine]), inline.
                    self.table.remove(entry)
                    entry.state = _DROPPED
                    self.resident_bytes -= entry.nbytes
                    entry.data = entry.alias = None
                elif entry.state is not S.DROPPED:
                    self._drop(entry)
        if dead:
            self.on_records_dead(dead)

    def _drop(self, entry: Entry) -> None:
        """Every handle of ``entry`` died (lock held): give back its memory, queue slot or
        offloader space."""
        if entry.state is None:  # pragma: no cover - never added (a bug upstream)
            return
        self.table.remove(entry)
        new = self._cancel_queued(entry, E.DROP) if entry.state is S.QUEUED else self._apply(entry, E.DROP)
        entry.data = None
        entry.alias = None
        xfer = entry.xfer
        if new is S.DROPPED:
            if xfer is not None and xfer.token is not None:
                self._release_token(xfer)
        else:
            self.orphans.add(entry)

    def _release_token(self, xfer: Transfer) -> None:
        """Give the offloader's space back (lock held); of a batch, this entry's share: the
        last share gives the batch's token back. A failure is raised in the step."""
        token, xfer.token = xfer.token, None
        if type(token) is Batch:
            batch = token
            batch.num_shares -= 1
            if batch.num_shares:
                return
            token, batch.token = batch.token, None
        assert self.offloader is not None
        try:
            self.offloader.release(token)
        except Exception as exc:  # raised in the training step, never swallowed
            self.step.num_io_errors += 1
            self.set_error(exc)

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers (a running transfer finishes first, bounded) and drop every entry.
        Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._stopping = True
            self._store_q.clear()
            self._load_q.clear()
            self._batch.clear()  # its entries are dropped below
            self._notify_everyone()
        self._join_workers()
        with self.lock:
            self.released.clear()
            for entry in list(self.orphans):
                if entry.state is S.ORPHAN_LOADING:  # queued, never started
                    self._abandon_load(entry)
            for entry in self.table.clear():
                xfer = entry.xfer
                if entry.state is S.LOADING:  # queued, never started: the workers stopped
                    self._apply(entry, E.ABANDON)
                if entry.state is not S.DROPPED:
                    self._drop(entry)
                if xfer is not None and xfer.load_done is not None:
                    xfer.load_done.set()
        interrupts.unguard(self.lock)
