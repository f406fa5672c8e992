"""`Entry` (one saved storage of one version-counter family at one version) and `Handle`
(what autograd keeps instead of the tensor)."""

from __future__ import annotations

import enum
import threading
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

    # Members are singletons: identity hashing is C-level (Enum's own __hash__ is Python code
    # and runs on every state test in the transfer hot path).
    __hash__ = object.__hash__


HOLDS_DATA = frozenset((State.KEPT, State.QUEUED, State.STORING, State.READY))


class Entry:
    """One storage, saved through one version-counter family at one version.

    See Note [Version-counter families] in ``tba/cache/table.py`` for why the family is part of
    the identity, and Note [Saved-version check] for ``alias`` and ``version``.
    """

    __slots__ = (
        "stamp", "family", "version", "alias", "geometry", "reloaded", "device",
        "nbytes", "data", "state", "token", "refs", "event", "load_event", "load_done", "error",
        "wanted", "offload", "scope", "inline", "page_offset",
    )

    def __init__(
        self,
        stamp: int,
        family: int,
        tensor: torch.Tensor,
        data: torch.UntypedStorage,
        nbytes: int,
        offload: bool,
        scope: Any,
    ) -> None:
        self.stamp = stamp
        self.family = family  # stamp of the family's root tensor (Note [Version-counter families])
        self.version = tensor._version
        # A detached alias shares the family's version counter: it lets the check at unpack see
        # every in-place write of the family, also after the saved tensor object died. While
        # the entry holds its original storage it is also what unpack hands back to the first
        # saver (no new view).
        self.alias: torch.Tensor | None = tensor.detach()
        self.geometry: tuple | None = None  # the alias's (dtype, size, stride, offset), once released
        self.reloaded = False  # ``data`` is a reloaded copy, not the original storage
        self.device = data.device
        self.nbytes = nbytes
        self.data: torch.UntypedStorage | None = data  # the whole storage, while in memory
        self.state = State.KEPT
        self.token: Any = None
        self.refs = 0
        self.event: Any = None  # producer token (event and stream) recorded at pack time
        self.load_event: Any = None
        self.load_done: threading.Event | None = None
        self.error: BaseException | None = None
        self.wanted = False  # backward is near: keep the bytes in memory once a store finishes
        self.offload = offload
        self.scope = scope  # the scope that saved it first, for error messages
        self.inline = False  # stored on the training thread: loaded where unpacked (Note [Small transfers inline])
        # The stored bytes' address modulo the page: host reload buffers get the same (Note
        # [Reload buffers at the source's page offset]).
        self.page_offset = 0

    def remember_geometry(self) -> tuple:
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
    entry's first saver (then the entry's alias has it). When autograd frees the handle (the
    saving node ran, or its graph died) ``release(entry)`` runs: the entry loses a reference
    and, with none left, is dropped (memory, file space, pool slot).
    """

    __slots__ = ("entry", "release", "geometry", "scope", "__weakref__")

    def __init__(
        self,
        entry: Entry,
        release: Callable[[Entry], None],
        geometry: tuple | None,
        scope: Any,
    ) -> None:
        self.entry = entry
        self.release = release
        self.geometry = geometry
        self.scope = scope

    def __del__(self) -> None:
        self.release(self.entry)
