"""Small CPU stores made together: the entries a unit marks for offload that the offloader can
take at once share one store and one load (``InlineBatches``: a mixin of ``Engine``, whose lock,
state machine and counters it uses).

Note [Small transfers in batches]: a small CPU storage is cheaper to copy than to hand to a
worker (Note [Small transfers inline] in workers.py), and the copy itself is cheaper than what
goes around it: finding and freeing room in the offloader's pool, timing the copy, a trace
event, a profiler range, allocating the reload buffer. So the new entries of that kind (a CPU
storage of at most ``INLINE_MAX_BYTES``, an offloader with ``store_now``) wait in the engine's
*pending batch* (state QUEUED: in memory, counted in flight) and are stored together: at the end
of the unit that saved them (``flush``), when the batch reaches ``WAKE_BYTES``, before a wait for
stores or for room, and at close. One store copies their bytes, each at an offset aligned to
``BATCH_ALIGNMENT``, into one staging storage and hands that to ``store_now``: one pool extent,
one token (a ``Batch``, shared by the entries: each holds a share until it is reloaded or
dropped, and the last share gives the offloader's token back). The first unpack of any of them
reads the whole batch back into one buffer, which then serves every entry of the batch: their
loads copy nothing (each views the buffer at its offset, ``Transfer.data_offset``). Every entry
still moves through the state machine on its own (QUEUE, STORED_BATCH, LOAD, LOAD_DONE, DROP),
inside the engine's critical section, so the invariant check and the interrupt sweep see the
same states and counters as for any store; a batch the offloader cannot take at once (no room
without growing the pool) goes to the workers entry by entry, as single stores do. An entry
backward wants (or the kept tail saves again, or that dies) while it waits in the batch leaves
it (its store is cancelled). Tested by tests/cache/test_batches.py.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tba.cache.engine.entries import Entry, Transfer
from tba.cache.engine.states import Event, State
from tba.cache.engine.workers import offloader_error
from tba.cache.observe.profiler_ranges import transfer_range
from tba.settings import WAKE_BYTES

if TYPE_CHECKING:
    import collections
    import threading

    from tba.cache.observe.stats import CacheStats
    from tba.cache.observe.trace import TraceRecorder

__all__ = ["Batch", "InlineBatches", "BATCH_ALIGNMENT"]

E, S = Event, State

#: Offset alignment of the entries in a batch (bytes): a multiple of every dtype's item size
#: (complex128's 16 the largest), so an entry's elements can be viewed in place in the reloaded
#: buffer; no more, so that a batch stores little besides its entries' bytes (an offloader that
#: charges by the byte, like the scripted world's, sees what the cache counts).
BATCH_ALIGNMENT = 16


def _aligned(nbytes: int) -> int:
    return (nbytes + BATCH_ALIGNMENT - 1) & -BATCH_ALIGNMENT


class Batch:
    """One store of several entries: the offloader's token, its size (alignment included) and
    the entries' bytes in it, how many entries still hold a share of it, and the buffer it was
    read back into (None until then)."""

    __slots__ = ("token", "nbytes", "payload_bytes", "num_shares", "buffer")

    def __init__(self, token: Any, nbytes: int, payload_bytes: int, num_shares: int) -> None:
        self.token = token
        self.nbytes = nbytes
        self.payload_bytes = payload_bytes
        self.num_shares = num_shares
        self.buffer: torch.UntypedStorage | None = None


class InlineBatches:
    """The pending batch and batched stores and loads of ``Engine`` (a mixin)."""

    lock: threading.RLock
    offloader: Any  # an Offloader: batches exist only with one that has ``store_now``
    _store_now: Any
    _store_q: collections.deque[Entry]
    _unwoken_bytes: int
    _threads: list[Any]
    step: CacheStats
    trace: TraceRecorder
    error: BaseException | None
    _apply: Callable[[Entry, Event], State]
    _start_workers: Callable[[], None]
    _store_failed: Callable[[Entry, BaseException], None]
    _resized: Callable[[Entry], None]
    _let_go: Callable[[Entry], None]
    _release_token: Callable[[Transfer], None]

    def _init_batches(self) -> None:
        self._batch: list[Entry] = []  # the pending batch, in save order
        self._batch_bytes = 0  # its bytes with alignment: the staging storage's size

    def _add_to_batch(self, entry: Entry) -> None:
        """A new entry joins the pending batch (lock held); a full batch is stored."""
        self._apply(entry, E.QUEUE)
        self._batch.append(entry)
        self._batch_bytes += _aligned(entry.nbytes)
        if self._batch_bytes >= WAKE_BYTES:
            self.store_batch()

    def _leave_batch(self, entry: Entry) -> None:
        """A pending entry's store is cancelled or it died (lock held): out of the batch."""
        self._batch.remove(entry)
        self._batch_bytes -= _aligned(entry.nbytes)

    def store_batch(self) -> None:
        """Store the pending batch now (lock held): Note [Small transfers in batches]."""
        pending = self._batch
        if not pending:
            return
        self._batch, self._batch_bytes = [], 0
        entries = []
        for entry in pending:
            assert entry.data is not None
            if entry.data.nbytes() != entry.nbytes:
                self._resized(entry)  # Note [Storages freed behind tba's back]: never read it
            else:
                entries.append(entry)
        if not entries:
            return
        offsets = []  # of each entry in the batch
        total = payload = 0
        for entry in entries:
            offsets.append(total)
            total += _aligned(entry.nbytes)
            payload += entry.nbytes
        start = time.perf_counter()
        token, failure = None, None
        try:
            with transfer_range("store", entries[0]):
                staging = torch.UntypedStorage(total)
                base = staging.data_ptr()
                for entry, offset in zip(entries, offsets):
                    ctypes.memmove(base + offset, entry.data.data_ptr(), entry.nbytes)  # type: ignore[union-attr]
                token = self._store_now(staging)
        except Exception as exc:  # raised in the training step, never swallowed
            failure = exc
        end = time.perf_counter()
        if failure is not None:
            for entry in entries:
                self._apply(entry, E.START_STORE)
                self._store_failed(entry, failure)
            return
        if token is None:  # no room at once: the workers store them one by one
            self._to_workers(entries)
            return
        # Note [Inline CPU time]: an inline copy never blocks, so its wall time is its CPU time.
        self.step.io_cpu_s += end - start
        self.step.write_s += end - start
        self.trace.span("store", start, end, payload, True)
        batch = Batch(token, total, payload, len(entries))
        for entry, offset in zip(entries, offsets):
            xfer = entry.xfer
            assert xfer is not None
            xfer.token, xfer.data_offset = batch, offset
            self._apply(entry, E.STORED_BATCH)
            self._let_go(entry)

    def _to_workers(self, entries: list[Entry]) -> None:
        """Queued entries the offloader could not take at once: stores of their own (lock held)."""
        for entry in entries:
            xfer = entry.xfer
            assert xfer is not None
            xfer.inline = False
            self._store_q.append(entry)
            self._unwoken_bytes += entry.nbytes
        if not self._threads:
            self._start_workers()

    def _load_batched(self, entry: Entry, xfer: Transfer) -> tuple[torch.UntypedStorage, None]:
        """Read a stored batched entry back on this thread (lock held): the whole batch on its
        first load, a view of that buffer after. Returns what ``fetch`` returns; raises the
        load's error (the entry stays STORED)."""
        batch = xfer.token
        assert type(batch) is Batch
        self._apply(entry, E.LOAD)
        buffer = batch.buffer
        if buffer is None:
            start = time.perf_counter()
            try:
                dst = torch.empty(batch.nbytes, dtype=torch.uint8)
                with transfer_range("load", entry):
                    self.offloader.load(batch.token, dst)
            except Exception as exc:  # raised to the caller
                self._apply(entry, E.LOAD_FAILED)
                self.trace.span("load", start, time.perf_counter(), batch.payload_bytes, False)
                raise offloader_error(self.offloader, "load", batch.nbytes, exc) from exc
            end = time.perf_counter()
            self.step.io_cpu_s += end - start  # Note [Inline CPU time]
            self.step.read_s += end - start
            self.trace.span("load", start, end, batch.payload_bytes, True)
            buffer = batch.buffer = dst.untyped_storage()
        entry.data, xfer.reloaded = buffer, True
        self._apply(entry, E.LOAD_DONE)  # RELOADED: holds no offloader space
        self._release_token(xfer)  # its share (Note [A reloaded entry holds no offloader space])
        return buffer, None
