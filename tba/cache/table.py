"""`EntryTable`: which saves share an entry (identity), reference counts and release.

Note [Version-counter families]: PyTorch's version counter belongs to a *view family* (a base
tensor and every view of it, plus ``detach()`` aliases), not to a storage. ``unsafe_chunk`` /
``unsafe_split`` outputs and tensors obtained through ``.data`` share a storage but each has a
counter of its own; PyTorch's CPU GRU/LSTM kernels split one gate storage this way and write
the chunks in place. Two such tensors can be saved at the same version number after the bytes
changed. An entry snapshots the whole storage when its store runs, so sharing one entry between
them hands backward stale bytes. Two saves therefore share an entry only when plain PyTorch
would hand backward the same bytes for both: the same storage (stamp, Note [Storage stamps]),
the same family (the root tensor of the view family, ``t._base`` or ``t`` itself, stamped like
storages: the stamp lives and dies with the root's Python object) and the same version. A save of a storage already held under another family gets an entry of its own
(written again: correctness first) and is counted in ``CacheStats.num_family_entries``.
``detach()`` aliases are treated as families of their own (conservative: at worst a second
write).

Note [Saved-version check]: with saved-tensor hooks installed, autograd skips its own check that
a saved tensor was not modified in place before backward used it (``saved_variable.cpp``: "Only
check version counter in the case without hooks"). tba redoes it: each entry remembers the
family's version at pack and keeps a detached alias (sharing the version counter, not the
graph); when its store finishes the worker swaps the alias's storage for an empty one without
touching the counter, so the family's writes stay observable without holding memory, also
after every tensor of the family died (as autograd's SavedVariable keeps the counter). Unpack
raises PyTorch's error when the version moved (a write during the store, which may have torn
the snapshot, moved it too). Not detectable: a write through another
family (``.data``, ``unsafe_chunk`` siblings), which plain PyTorch does not detect either and
which no offloader can honour (backward sees the bytes at store time, PyTorch the bytes at
backward time).
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Callable

import torch

from tba._torch_compat import FAMILY_ATTR, STAMP_ATTR
from tba.cache.entries import Entry, Handle

__all__ = ["EntryTable"]

_STAMPS = itertools.count(1)  # Note [Storage stamps]

# Note [Releases from the collector]: True while the garbage collector runs (set by a
# ``gc.callbacks`` entry that the first EntryTable installs): a release then may come from
# inside any lock of this thread, tba's or an offloader's.
_collecting = False
_callback_installed = False


def _on_collection(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


def _install_collection_callback() -> None:
    global _callback_installed
    if not _callback_installed:
        _callback_installed = True
        gc.callbacks.append(_on_collection)


def _nothing(*args: object) -> None:
    return None


class EntryTable:
    """Live entries by storage stamp. Thread-safe: packs may come from several threads and
    releases from autograd's threads.

    Args:
        min_offload_bytes: smaller storages are never offloaded.
        on_drop: called (no lock held) with each entry whose last handle died.
        on_empty: called (no lock held) after the last entry was dropped.
    """

    def __init__(
        self,
        min_offload_bytes: int,
        on_drop: Callable[[Entry], None],
        on_empty: Callable[[], None],
        engine_busy: Callable[[], bool] = lambda: False,
    ) -> None:
        # Reentrant only so that ``_is_owned`` can tell Note [Releases from the collector].
        self.lock = threading.RLock()
        self._engine_busy = engine_busy
        self._deferred: list[Entry] = []
        _install_collection_callback()
        self._by_stamp: dict[int, list[Entry]] = {}
        self._min_offload_bytes = min_offload_bytes
        self._on_drop = on_drop
        self._on_empty = on_empty
        self.num_entries = 0
        self.num_packed = 0
        self.num_deduplicated = 0
        self.num_family_entries = 0
        self.closed = False

    def handle(
        self,
        tensor: torch.Tensor,
        storage: torch.UntypedStorage,
        root: torch.Tensor,
        scope: object,
        offload: bool,
    ) -> tuple[Handle, Entry | None]:
        """A handle for ``tensor`` (a plain strided tensor on ``storage``, ``root`` the base of
        its view family): an existing entry of the same storage, family and version, or a new
        one, offloaded if ``offload`` and the storage is at least ``min_offload_bytes``.
        Returns (handle, the entry if it is new); the caller hands a new entry to the transfer
        engine (its reference is counted already, so it cannot be dropped meanwhile)."""
        if self._deferred:  # a list test only: pack runs for every saved tensor
            self.drain_if_safe()  # Note [Releases from the collector]
        stamp = getattr(storage, STAMP_ATTR, None)
        if stamp is None:
            stamp = next(_STAMPS)
            setattr(storage, STAMP_ATTR, stamp)
        family = getattr(root, FAMILY_ATTR, None)
        if family is None:
            family = next(_STAMPS)
            setattr(root, FAMILY_ATTR, family)
        version = tensor._version
        with self.lock:
            self.num_packed += 1
            same = self._by_stamp.get(stamp)
            if same is not None:
                for entry in same:
                    if entry.family == family and entry.version == version:
                        self.num_deduplicated += 1
                        entry.refs += 1
                        break
                else:
                    entry = None
                if entry is not None:
                    geometry = (
                        tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()
                    )
                    return Handle(entry, self.release, geometry, scope), None
                if any(e.family != family for e in same):
                    self.num_family_entries += 1
            else:
                same = self._by_stamp[stamp] = []
            nbytes = storage.nbytes()
            entry = Entry(
                stamp, family, tensor, storage, nbytes,
                offload and nbytes >= self._min_offload_bytes, scope,
            )
            entry.refs = 1
            same.append(entry)
            self.num_entries += 1
        return Handle(entry, self.release, None, scope), entry

    def release(self, entry: Entry) -> None:
        """One handle of ``entry`` died (``Handle.__del__``).

        Note [Releases from the collector]: a handle can die inside the garbage collector,
        which runs at whatever allocation crosses its threshold, also one made while this
        thread holds the table's or the engine's lock (creating an entry, finishing a
        transfer) or an offloader's lock (allocating an extent). Handles held by a reference
        cycle (an exception's traceback holding a failed step's graph) die that way. Taking
        the lock again there would deadlock the thread on itself; such a release (any release
        while the collector runs, or while this thread holds the table's or the engine's
        lock) is queued instead and done by the next release or pack outside the collector
        and the locks, or by the cache's next ``stats``, ``summary`` or ``wait_for_stores``
        (``drain_if_safe``): a step whose last release was queued still ends."""
        if _collecting or self.lock._is_owned() or self._engine_busy():  # type: ignore[attr-defined]
            self._deferred.append(entry)  # list.append is atomic
            return
        self._release(entry)
        if self._deferred:
            self.drain()

    def drain_if_safe(self) -> None:
        """Do the queued releases now unless this thread is inside the collector or holds the
        table's or the engine's lock (Note [Releases from the collector]). Called at every
        pack and by the cache's public calls (``stats``, ``summary``, ``wait_for_stores``), so
        a step whose last release the collector made still ends without another forward."""
        if self._deferred and not _collecting and not self.lock._is_owned() and not self._engine_busy():  # type: ignore[attr-defined]
            self.drain()

    def drain(self) -> None:
        """Do the releases queued by Note [Releases from the collector] (no lock held)."""
        deferred = self._deferred
        while deferred:
            try:
                entry = deferred.pop()
            except IndexError:  # another thread drained it meanwhile
                return
            self._release(entry)

    def _release(self, entry: Entry) -> None:
        with self.lock:
            entry.refs -= 1
            if entry.refs or self.closed:
                return
            same = self._by_stamp.get(entry.stamp)
            if same is not None:
                same.remove(entry)
                if not same:
                    del self._by_stamp[entry.stamp]
            self.num_entries -= 1
            empty = self.num_entries == 0
        # Outside the table lock: the engine gives space back to the offloader here, and no
        # offloader call is made under a cache lock. The entry is out of the table and has no
        # handle left, so nothing can reach it meanwhile.
        self._on_drop(entry)
        if empty:
            self._on_empty()  # lock order is hooks -> table -> engine

    def entries(self) -> list[Entry]:
        """Every live entry (a copy)."""
        with self.lock:
            return [e for same in self._by_stamp.values() for e in same]

    def take_counts(self) -> tuple[int, int, int]:
        """(handles made, deduplicated saves, family entries) since the last call."""
        with self.lock:
            counts = (self.num_packed, self.num_deduplicated, self.num_family_entries)
            self.num_packed = self.num_deduplicated = self.num_family_entries = 0
            return counts

    def close(self) -> list[Entry]:
        """Forget every entry (releases after this are no-ops); returns them."""
        with self.lock:
            self.closed = True
            # Live graphs still hold handles, hence this table: let go of the cache.
            self._on_drop = self._on_empty = _nothing  # type: ignore[assignment]
            out = [e for same in self._by_stamp.values() for e in same]
            self._by_stamp.clear()
            self.num_entries = 0
            return out
