"""`Entry` (one saved storage at one version) and `Handle` (what autograd keeps instead)."""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tba.cache.scopes import Scope
    from tba.cache.tensor_cache import TensorCache

__all__ = ["State", "Entry", "Handle"]


class State(enum.Enum):
    """Where an entry's bytes are. ``data`` is held in QUEUED, STORING, READY and KEPT."""

    KEPT = "kept"  # in memory, never offloaded
    QUEUED = "queued"  # in memory, store waiting for a worker
    STORING = "storing"  # in memory, store running
    STORED = "stored"  # only in the offloader
    LOADING = "loading"  # load running
    READY = "ready"  # in memory and in the offloader (loaded, or stored while wanted)
    DROPPED = "dropped"  # every handle died


class Entry:
    """One storage (at one version counter value) saved for backward.

    Identity is a counter stamp on the storage plus its version, so views of one storage share
    an entry (written once) and an in-place change makes a new one (see Note [Storage stamps]).
    """

    __slots__ = (
        "key", "device", "nbytes", "data", "state", "token", "refs", "event",
        "load_event", "load_done", "error", "wanted", "offload",
    )

    def __init__(self, key: tuple[int, int], data: torch.UntypedStorage, offload: bool) -> None:
        self.key = key
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


class Handle:
    """Returned by the pack hook; autograd holds it instead of the tensor.

    When autograd frees it (the saving node ran, or its graph died) the entry loses a reference;
    an entry with none left is dropped: memory, file space and pool slot are given back.
    """

    __slots__ = ("cache", "entry", "dtype", "size", "stride", "offset", "scope", "__weakref__")

    def __init__(
        self,
        cache: TensorCache,
        entry: Entry,
        tensor: torch.Tensor,
        scope: Scope,
    ) -> None:
        self.cache = cache
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.scope = scope

    def __del__(self) -> None:
        self.cache._release(self.entry)
