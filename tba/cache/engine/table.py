"""`EntryTable`: which saves share an entry (identity). No lock of its own: the engine calls it
under its lock.

Note [Version-counter families]: PyTorch's version counter belongs to a *view family* (a base
tensor and every view of it, plus ``detach()`` aliases), not to a storage. ``unsafe_chunk`` /
``unsafe_split`` outputs and tensors obtained through ``.data`` share a storage but each has a
counter of its own; PyTorch's CPU GRU/LSTM kernels split one gate storage this way and write
the chunks in place. Two such tensors can be saved at the same version number after the bytes
changed. An entry snapshots the whole storage when its store runs, so sharing one entry between
them hands backward stale bytes. Two saves therefore share an entry only when plain PyTorch
would hand backward the same bytes for both: the same storage (stamp, Note [Storage stamps]),
the same family (the root tensor of the view family, ``t._base`` or ``t`` itself, stamped like
storages: the stamp lives and dies with the root's Python object) and the same version. A save
of a storage already held under another family gets an entry of its own (written again:
correctness first) and is counted in ``CacheStats.num_family_entries``. ``detach()`` aliases
are treated as families of their own (conservative: at worst a second write).

Note [Saved-version check]: with saved-tensor hooks installed, autograd skips its own check that
a saved tensor was not modified in place before backward used it (``saved_variable.cpp``: "Only
check version counter in the case without hooks"). tba redoes it: each entry remembers the
family's version at pack and keeps a detached alias (sharing the version counter, not the
graph); when its store finishes the worker swaps the alias's storage for an empty one without
touching the counter, so the family's writes stay observable without holding memory, also
after every tensor of the family died (as autograd's SavedVariable keeps the counter). Unpack
raises PyTorch's error when the version moved (a write during the store, which may have torn
the snapshot, moved it too). Not detectable: a write through another family (``.data``,
``unsafe_chunk`` siblings), which plain PyTorch does not detect either and which no offloader
can honour (backward sees the bytes at store time, PyTorch the bytes at backward time).
"""

from __future__ import annotations

import itertools

from tba._torch_compat import FAMILY_ATTR, STAMP_ATTR
from tba.cache.engine.entries import Entry

__all__ = ["EntryTable", "next_stamp", "STAMP_ATTR", "FAMILY_ATTR"]

#: A new stamp (Note [Storage stamps]: a counter, never a pointer or a clock).
next_stamp = itertools.count(1).__next__


class EntryTable:
    """Live entries by storage stamp (one dict entry per storage: the entries of one stamp are
    chained through ``Entry.same``), and the per-step counts of saves."""

    def __init__(self) -> None:
        self.by_stamp: dict[int, Entry] = {}  # the engine's save reads it for the new-storage case
        self.num_entries = 0
        # Counts of the running step (the engine adds to them in ``save``).
        self.num_packed = 0
        self.num_deduplicated = 0
        self.num_family_entries = 0

    def find(self, stamp: int, family: int, version: int) -> tuple[Entry | None, bool]:
        """(the live entry of storage ``stamp``, family ``family`` and ``version`` or None,
        whether that storage is held under another family)."""
        entry = self.by_stamp.get(stamp)
        other_family = False
        while entry is not None:
            if entry.family == family:
                if entry.version == version:
                    return entry, False
            else:
                other_family = True
            entry = entry.same
        return None, other_family

    def insert(self, entry: Entry) -> None:
        by_stamp = self.by_stamp
        entry.same = by_stamp.get(entry.stamp)
        by_stamp[entry.stamp] = entry
        self.num_entries += 1

    def remove(self, entry: Entry) -> None:
        by_stamp = self.by_stamp
        head = by_stamp.get(entry.stamp)
        if head is entry:
            if entry.same is None:
                del by_stamp[entry.stamp]
            else:
                by_stamp[entry.stamp] = entry.same
        else:
            while head is not None and head.same is not entry:
                head = head.same
            if head is None:
                return
            head.same = entry.same
        entry.same = None
        self.num_entries -= 1

    def entries(self) -> list[Entry]:
        """Every live entry (a copy)."""
        out = []
        for head in self.by_stamp.values():
            entry: Entry | None = head
            while entry is not None:
                out.append(entry)
                entry = entry.same
        return out

    def take_counts(self) -> tuple[int, int, int]:
        """(handles made, deduplicated saves, family entries) since the last call."""
        counts = (self.num_packed, self.num_deduplicated, self.num_family_entries)
        self.num_packed = self.num_deduplicated = self.num_family_entries = 0
        return counts

    def clear(self) -> list[Entry]:
        """Forget every entry; returns them."""
        out = self.entries()
        self.by_stamp.clear()
        for entry in out:
            entry.same = None
        self.num_entries = 0
        return out
