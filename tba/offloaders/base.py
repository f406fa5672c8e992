"""The offloader plug point: moves the bytes of one storage out of device memory and back."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Offloader", "StoresNow"]


@runtime_checkable
class Offloader(Protocol):
    """Moves the bytes of one activation storage out of device memory and back.

    The tensor cache decides *what* and *when*; an offloader only moves bytes. The cache calls
    ``store`` on its store threads and ``load`` on its load threads (several may run at once, so
    implementations must be thread-safe), always with the cache's transfer stream current on
    CUDA and after the data's producer has finished. Both calls are blocking: when they return,
    the bytes are where they should be (the offloader synchronises its own copies). Errors are
    raised as exceptions (``tba.OffloadIOError`` for I/O); the cache re-raises them on the
    training thread or, with ``on_io_error="keep"``, keeps the tensor in memory.

    Optional: ``store_now(storage) -> token | None``. For small CPU storages (Note [Small
    transfers inline] in tba/cache/engine/workers.py) the cache calls it on the training thread
    at pack time, inside its critical section (Note [Interrupt-safe bookkeeping]); it must
    return at once (no allocation, no I/O wait): a token, or None to have the storage stored by
    ``store`` on a worker. A token from it is loaded with ``load`` on the thread that unpacks
    the tensor, also inside that section. ``HostOffloader`` implements it.

    ``release`` runs on the training thread inside the cache's critical section too: it must
    only give space back (no I/O wait).

    Example:
        >>> class Mine:
        ...     name = "mine"
        ...     def store(self, src): return src.clone()
        ...     def load(self, token, dst): dst.copy_(token)
        ...     def release(self, token): pass
        ...     def reserve(self, num_bytes): pass
        ...     def close(self): pass
        >>> cache = tba.configure_tensor_cache(model, offloader=Mine())  # doctest: +SKIP
    """

    name: str

    def store(self, src: torch.Tensor) -> Any:
        """Copy every byte of ``src`` (1-D, contiguous, ``torch.uint8``) out; return a token."""
        ...

    def load(self, token: Any, dst: torch.Tensor) -> None:
        """Fill ``dst`` (1-D, contiguous ``torch.uint8``, same size as stored) from ``token``."""
        ...

    def release(self, token: Any) -> None:
        """Give back the space held by ``token``; it is never loaded again."""
        ...

    def reserve(self, num_bytes: int) -> None:
        """Hint from the profiled step: about ``num_bytes`` will be held at once. May do nothing.

        ``num_bytes == 0``: the policy decided to offload nothing for now: give back memory kept
        for transfers that nothing uses (staging buffers, empty pool space); stores may come
        again later (a new profile) and may allocate it again.

        Called on a store worker while no transfer runs, never under the cache's locks (it may
        take time: pinning memory, preallocating files); an exception is raised in the
        training step."""
        ...

    def close(self) -> None:
        """Release every resource (memory, files, threads). Idempotent."""
        ...


class StoresNow(Protocol):
    """The optional part of an ``Offloader`` (see its docstring): ``store_now``."""

    def store_now(self, storage: torch.UntypedStorage) -> Any:
        """Store ``storage`` at once and return a token, or None to leave it to ``store``."""
        ...
