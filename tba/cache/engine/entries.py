"""`Entry` (one saved storage of one version-counter family at one version), its `Transfer`
fields (only for entries that are offloaded), and `Handle` (what autograd keeps instead of the
tensor); `SavedScope` and `SavedRecord`: what the engine knows of the scopes and records of the
capture side (``tba.cache.steps.scopes``), which it holds for the capture but never imports."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tba.cache.engine.states import State
from tba.cache.observe.profiler_ranges import UnitScope

if TYPE_CHECKING:
    from tba.cache.observe.profiler_ranges import LoadDone

__all__ = ["Entry", "Transfer", "Handle", "HandleRef", "Geometry", "SavedScope", "SavedRecord"]


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
        "reloaded",
    )

    def __init__(self, device: torch.device, event: Any) -> None:
        self.device = device
        self.token: Any = None
        self.event = event  # producer token (event and stream) recorded at pack time
        self.load_event: Any = None
        self.load_done: LoadDone | None = None  # while a worker loads it
        self.error: BaseException | None = None  # a failed load, for the unpack that waits
        self.inline = False  # stored on the training thread: loaded where unpacked
        # The stored bytes' address modulo the page: host reload buffers get the same (Note
        # [Reload buffers at the source's page offset]).
        self.page_offset = 0
        self.reloaded = False  # the entry's data is a reloaded copy, not the original storage


class Entry:
    """One storage, saved through one version-counter family at one version.

    See Note [Version-counter families] in ``tba/cache/engine/table.py`` for why the family is
    part of the identity, and Note [Saved-version check] for ``alias`` and ``version``.
    """

    __slots__ = (
        "stamp", "family", "version", "alias", "geometry", "nbytes", "data", "state", "handles",
        "scope", "xfer",
    )

    def __init__(
        self,
        stamp: int,
        family: int,
        tensor: torch.Tensor,
        data: torch.UntypedStorage,
        nbytes: int,
        scope: SavedScope,
    ) -> None:
        self.stamp = stamp
        self.family = family  # stamp of the family's root tensor (Note [Version-counter families])
        self.version = tensor._version
        # A detached alias shares the family's version counter: it lets the check at unpack see
        # every in-place write of the family, also after the saved tensor object died. While
        # the entry holds its original storage it is also what unpack hands back to the first
        # saver (no new view).
        self.alias: torch.Tensor | None = tensor.detach()
        self.geometry: Geometry | None = None  # the alias's (dtype, size, stride, offset), once released
        self.nbytes = nbytes
        self.data: torch.UntypedStorage | None = data  # the whole storage, while in memory
        self.state: State | None = None  # None until the engine added it
        self.handles: list[HandleRef] = []  # one per live handle: the reference count
        self.scope = scope  # the scope that saved it first, for error messages and ranges
        self.xfer: Transfer | None = None  # set when the entry is offloaded

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


class Handle:
    """Returned by the pack hook; autograd holds it instead of the tensor.

    ``geometry`` is the saved tensor's (dtype, size, stride, offset), or None when it is the
    entry's first saver (then the entry's alias has it). When autograd frees the handle, its
    ``HandleRef`` is queued for release (Note [Interrupt-safe bookkeeping]): the entry loses a
    reference and, with none left, is dropped (memory, file space, pool slot).
    """

    __slots__ = ("entry", "geometry", "scope", "__weakref__")

    def __init__(self, entry: Entry, geometry: Geometry | None, scope: SavedScope) -> None:
        self.entry = entry
        self.geometry = geometry
        self.scope = scope


class HandleRef(weakref.ref[Handle]):
    """A weak reference to a ``Handle`` whose callback (``deque.append``: C code, no Python
    frame) queues it for release when the handle dies; the entry keeps it alive."""

    __slots__ = ("entry", "record")

    entry: Entry
    record: SavedRecord
