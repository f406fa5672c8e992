"""`Entry` (one saved storage of one version-counter family at one version), its `Transfer`
fields (only for entries that are offloaded), and `Handle` (what autograd keeps instead of the
tensor); `SavedScope` and `SavedRecord`: what the engine knows of the scopes and records of the
capture side (``tba.cache.steps.scopes``), which it holds for the capture but never imports."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tba.cache.engine.states import State
from tba.cache.observe.profiler_ranges import UnitScope

if TYPE_CHECKING:
    from tba.cache.observe.profiler_ranges import LoadDone

__all__ = [
    "Entry", "Transfer", "Handle", "HandleRef", "Geometry", "SavedScope", "SavedRecord", "new_entry",
]


class SavedScope(UnitScope, Protocol):
    """The scope a tensor was saved into, as the engine sees it (``Scope``): whether its
    tensors stay in memory, its entries in save order (what backward prefetches), and its unit
    (for ranges and messages). Entries and handles keep the object they were given, so the
    capture side reads its own ``Scope`` back from them."""

    @property
    def keep(self) -> bool: ...

    @property
    def entries(self) -> list[Entry]: ...


class SavedRecord(Protocol):
    """The forward pass a handle belongs to, as the engine sees it (``Record``): its live
    handles (the engine counts them), whether it offloads anything (the engine says so when it
    marks an entry for offload) and whether its forward ended (then no handle left means its
    graph is gone)."""

    num_handles: int
    offloads: bool

    @property
    def forward_done(self) -> bool: ...

#: A saved tensor's (dtype, size, stride, storage offset): enough to view it on its storage.
Geometry = tuple[torch.dtype, torch.Size, tuple[int, ...], int | torch.SymInt]


class Transfer:
    """What only an offloaded entry needs: where its bytes went and how its copies are ordered."""

    __slots__ = (
        "device", "token", "event", "load_event", "load_done", "error", "inline", "page_offset",
        "reloaded", "data_offset",
    )

    def __init__(self, device: torch.device, event: Any) -> None:
        self.device = device
        self.token: Any = None
        self.event = event  # producer token (event and stream) recorded at pack time
        self.load_event: Any = None
        self.load_done: LoadDone | None = None  # while a worker loads it
        self.error: BaseException | None = None  # a failed load, for the unpack that waits
        self.inline = False  # stored in a batch on the training thread: loaded where unpacked
        # The stored bytes' address modulo the page: host reload buffers get the same (Note
        # [Reload buffers at the source's page offset]).
        self.page_offset = 0
        self.reloaded = False  # the entry's data is a reloaded copy, not the original storage
        # Where the entry's bytes begin in its ``data`` once reloaded: its offset in its batch's
        # buffer (Note [Small transfers in batches]); while stored, its offset in the batch.
        self.data_offset = 0


class Handle:
    """Returned by the pack hook; autograd holds it instead of the tensor.

    ``view`` says how unpack hands the saved tensor back: None for the entry's first saver (the
    entry's alias is that tensor); for a later saver of an entry kept in memory from the start
    (no ``xfer``), a detached alias of its own (no new view to build at unpack); otherwise its
    (dtype, size, stride, offset) on the entry's storage (a reloaded copy, maybe). When autograd
    frees the handle, its weak reference is queued for release (Note [Interrupt-safe
    bookkeeping]): the entry loses a reference and, with none left, is dropped (memory, file
    space, pool slot). The engine sets the fields (no ``__init__``: a handle is made for every
    save).
    """

    __slots__ = ("entry", "view", "scope", "__weakref__")

    entry: Entry
    view: Geometry | torch.Tensor | None
    scope: SavedScope


class HandleRef(weakref.ref[Handle]):
    """A weak reference to a handle of an entry other than its first (those are the entry
    itself), whose callback (``deque.append``: C code, no Python frame) queues it for release
    when the handle dies; the entry keeps it alive (``Entry.others``)."""

    __slots__ = ("entry", "record")

    entry: Entry
    record: SavedRecord

    # Identity, not the referents' (weakref's own ``==`` compares live referents, and its hash
    # fails once the referent is dead).
    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__


class Entry(weakref.ref[Handle]):
    """One storage, saved through one version-counter family at one version; also the weak
    reference to its first handle (Note [One object per new entry]).

    See Note [Version-counter families] in ``tba/cache/engine/table.py`` for why the family is
    part of the identity, and Note [Saved-version check] for ``alias`` and ``version``.
    """

    __slots__ = (
        "stamp", "family", "version", "alias", "geometry", "nbytes", "data", "state",
        "num_handles", "others", "scope", "record", "xfer", "same",
    )

    stamp: int
    family: int  # stamp of the family's root tensor (Note [Version-counter families])
    version: int
    # A detached alias shares the family's version counter: it lets the check at unpack see
    # every in-place write of the family, also after the saved tensor object died. While the
    # entry holds its original storage it is also what unpack hands back to the first saver
    # (no new view).
    alias: torch.Tensor | None
    geometry: Geometry | None  # the alias's (dtype, size, stride, offset), once released
    nbytes: int
    data: torch.UntypedStorage | None  # the whole storage, while in memory
    state: State | None  # None until the engine added it
    num_handles: int  # live handles: the reference count
    others: list[HandleRef] | None  # the references of its handles after the first
    scope: SavedScope  # the scope that saved it first, for error messages and ranges
    record: SavedRecord  # the record of its first handle
    xfer: Transfer | None  # set when the entry is offloaded
    same: Entry | None  # the next live entry of the same storage stamp (EntryTable)

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def remember_geometry(self) -> Geometry:
        """The first saver's (dtype, size, stride, offset), read from the alias (kept after the
        alias lets go of the storage)."""
        geometry = self.geometry
        if geometry is None:
            alias = self.alias
            assert alias is not None, "tba bug: geometry of a dropped entry"
            geometry = self.geometry = (
                alias.dtype, alias.size(), alias.stride(), alias.storage_offset()
            )
        return geometry


# Note [One object per new entry]: every save makes a handle (what autograd keeps) and a weak
# reference to it (how its death is heard, Note [Interrupt-safe bookkeeping]); a save of a new
# storage also makes an entry. The entry *is* the weak reference of its first handle, and
# counts its handles in an integer (``num_handles``): a new entry costs three objects (the
# entry, its handle, its alias) where separate objects cost six, and fewer objects made per
# saved tensor means fewer garbage collections (which traverse every young object) per step.
# The references of later handles (``HandleRef``) are kept in ``others``, made only for an
# entry saved more than once; the release drain tells the two kinds apart by type.


def new_entry(
    handle: Handle,
    on_release: Callable[[HandleRef | Entry], object],
    stamp: int,
    family: int,
    tensor: torch.Tensor,
    data: torch.UntypedStorage,
    nbytes: int,
    scope: SavedScope,
    record: SavedRecord,
) -> Entry:
    """The entry of a new storage ``data`` saved as ``tensor`` through ``handle`` (its first
    handle, counted) into ``scope`` of ``record``; ``on_release`` gets the entry when that
    handle dies."""
    entry = Entry(handle, on_release)
    entry.stamp = stamp
    entry.family = family
    entry.version = tensor._version
    entry.alias = tensor.detach()
    entry.geometry = None
    entry.nbytes = nbytes
    entry.data = data
    entry.state = None
    entry.num_handles = 1
    entry.others = None
    entry.scope = scope
    entry.record = record
    entry.xfer = None
    entry.same = None
    handle.entry = entry
    handle.view = None
    return entry
