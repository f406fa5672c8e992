"""`Entry` (one saved storage of one version-counter family at one version) and `Handle`
(what autograd keeps instead of the tensor)."""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["State", "Entry", "Handle", "HOLDS_DATA"]


class State(enum.Enum):
    """Where an entry's bytes are. ``data`` is held in QUEUED, STORING, READY and KEPT."""

    KEPT = "kept"  # in memory, never offloaded
    QUEUED = "queued"  # in memory, store waiting for a worker
    STORING = "storing"  # in memory, store running
    STORED = "stored"  # only in the offloader
    LOADING = "loading"  # load running
    READY = "ready"  # in memory and in the offloader (loaded, or stored while wanted)
    DROPPED = "dropped"  # every handle died


HOLDS_DATA = frozenset((State.KEPT, State.QUEUED, State.STORING, State.READY))


class Entry:
    """One storage, saved through one version-counter family at one version.

    See Note [Version-counter families] in ``tba/cache/table.py`` for why the family is part of
    the identity, and Note [Saved-version check] for ``alias``, ``version`` and ``modified``.
    """

    __slots__ = (
        "stamp", "root", "version", "alias", "modified", "device", "nbytes", "data", "state",
        "token", "refs", "event", "load_event", "load_done", "error", "wanted", "offload",
        "where",
    )

    def __init__(
        self,
        stamp: int,
        root: weakref.ref,
        tensor: torch.Tensor,
        data: torch.UntypedStorage,
        offload: bool,
        where: str,
    ) -> None:
        self.stamp = stamp
        self.root = root  # weak reference to the family's root tensor (the base of views)
        self.version = tensor._version
        # A detached alias shares the family's version counter: it lets the check at unpack see
        # every in-place write of the family, also after the saved tensor object died.
        self.alias: torch.Tensor | None = tensor.detach()
        self.modified = False  # the family was written between pack and the end of the store
        self.device = data.device
        self.nbytes = data.nbytes()
        self.data: torch.UntypedStorage | None = data  # the whole storage, while in memory
        self.state = State.KEPT
        self.token: Any = None
        self.refs = 0
        self.event: Any = None  # producer event recorded at pack time
        self.load_event: Any = None
        self.load_done: threading.Event | None = None
        self.error: BaseException | None = None
        self.wanted = False  # backward is near: keep the bytes in memory once a store finishes
        self.offload = offload
        self.where = where  # the module that saved it first, for error messages

    def current_version(self) -> int | None:
        """The family's version now, or None when no tensor of the family is reachable."""
        alias = self.alias
        if alias is not None:
            return alias._version
        root = self.root()
        return None if root is None else root._version


class Handle:
    """Returned by the pack hook; autograd holds it instead of the tensor.

    When autograd frees it (the saving node ran, or its graph died) ``release(entry)`` runs: the
    entry loses a reference and, with none left, is dropped (memory, file space, pool slot).
    """

    __slots__ = ("entry", "release", "dtype", "size", "stride", "offset", "scope", "__weakref__")

    def __init__(
        self,
        entry: Entry,
        release: Callable[[Entry], None],
        tensor: torch.Tensor,
        scope: Any,
    ) -> None:
        self.entry = entry
        self.release = release
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.scope = scope

    def __del__(self) -> None:
        self.release(self.entry)
