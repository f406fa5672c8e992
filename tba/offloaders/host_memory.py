"""Host buffers of exactly the requested size, pinned with ``cudaHostRegister`` when asked.

Note [Pinned memory outside PyTorch's host allocator]
PyTorch's pinned (host) caching allocator, behind ``torch.empty(..., pin_memory=True)``, rounds
every request up to a power of two and keeps freed blocks cached until
``torch._C._host_emptyCache()``: a pool that grows by doubling slabs and is then resized by
``reserve()`` pins about three times what it holds, and never gives it back (in a
memory-limited cgroup that is an OOM kill). tba therefore takes host memory from anonymous
``mmap`` (page-aligned, exactly the pages asked for, returned to the OS when the buffer dies)
and pins it in place with ``cudaHostRegister``; ``release()`` unregisters it. Each buffer has
its own mapping, so no two registrations share a page (a shared page makes the second
``cudaHostRegister`` fail with "already registered"). Copies from registered memory are as
asynchronous as from PyTorch's pinned blocks (``Tensor.is_pinned()`` is True for them).

When pinning fails (locked-memory limit, no driver, an address range CUDA refuses) the buffer
stays pageable: transfers still work, synchronously and slower, and a warning says so once.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from tba.settings import PAGE_BYTES

__all__ = ["HostAllocator", "HostBuffer", "Pinner", "CudaHostRegister"]

logger = logging.getLogger(__name__)


class Pinner(Protocol):
    """Pins and unpins host address ranges for the GPU (the CUDA layer; tests inject a fake)."""

    def register(self, ptr: int, num_bytes: int) -> None:
        """Pin ``num_bytes`` at ``ptr``; raise on failure."""
        ...

    def unregister(self, ptr: int) -> None:
        """Unpin the range registered at ``ptr``."""
        ...


class CudaHostRegister:
    """The real ``Pinner``: ``cudaHostRegister`` / ``cudaHostUnregister`` through
    ``torch.cuda.cudart()`` (initialises CUDA at first use, never at construction)."""

    def register(self, ptr: int, num_bytes: int) -> None:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(ptr, num_bytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister({num_bytes} bytes) failed: {_error_text(cudart, error)}")

    def unregister(self, ptr: int) -> None:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostUnregister(ptr)
        if int(error) != 0:
            logger.warning("cudaHostUnregister(%#x) failed: %s", ptr, _error_text(cudart, error))


def _error_text(cudart: object, error: int) -> str:
    describe = getattr(cudart, "cudaGetErrorString", None)
    try:
        return f"{describe(error)} ({int(error)})" if describe is not None else str(int(error))
    except Exception:  # the description is best effort; the code is what matters
        return str(error)


@dataclasses.dataclass(eq=False)
class HostBuffer:
    """One host allocation: ``tensor`` is 1-D ``torch.uint8`` of exactly ``num_bytes``,
    page-aligned; ``pinned`` says whether it is registered with CUDA."""

    tensor: torch.Tensor | None
    num_bytes: int
    pinned: bool
    _unpin: Callable[[], None] | None = None

    @property
    def released(self) -> bool:
        return self.tensor is None

    def release(self) -> None:
        """Unpin (if pinned) and drop the memory. Idempotent."""
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()
        self.tensor = None  # the mapping is unmapped when the last view of it dies


class HostAllocator:
    """Allocates ``HostBuffer``s and counts what is pinned.

    Args:
        pinner: the pinning layer; default ``CudaHostRegister``.

    Example:
        >>> buf = HostAllocator().allocate(4096, pinned=False)
        >>> buf.tensor.numel(), buf.pinned
        (4096, False)
        >>> buf.release()
    """

    def __init__(self, pinner: Pinner | None = None) -> None:
        self._pinner = pinner if pinner is not None else CudaHostRegister()
        self._lock = threading.Lock()
        self._warned = False
        self.num_pin_failures = 0
        self.pinned_bytes = 0  # bytes registered now (page-rounded)

    def allocate(self, num_bytes: int, *, pinned: bool) -> HostBuffer:
        """A buffer of exactly ``num_bytes``; pinned if ``pinned`` and pinning works, else
        pageable (with a one-time warning)."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        mapped_bytes = (num_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
        mapping = mmap.mmap(-1, mapped_bytes)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)[:num_bytes]
        del mapping  # the tensor keeps it alive
        if not pinned:
            return HostBuffer(tensor, num_bytes, False)
        ptr = tensor.data_ptr()
        try:
            self._pinner.register(ptr, mapped_bytes)
        except Exception as exc:  # fall back to pageable memory: slower, still correct
            self._pin_failed(mapped_bytes, exc)
            return HostBuffer(tensor, num_bytes, False)
        with self._lock:
            self.pinned_bytes += mapped_bytes
        return HostBuffer(tensor, num_bytes, True, lambda: self._unpin(ptr, mapped_bytes))

    def _unpin(self, ptr: int, mapped_bytes: int) -> None:
        with self._lock:
            self.pinned_bytes -= mapped_bytes
        self._pinner.unregister(ptr)

    def _pin_failed(self, num_bytes: int, exc: BaseException) -> None:
        with self._lock:
            self.num_pin_failures += 1
            first, self._warned = not self._warned, True
        if first:
            warnings.warn(
                f"tba: pinning {num_bytes} bytes of host memory failed ({exc}); the host pool "
                "uses pageable memory instead, so transfers are synchronous and slower. Raise "
                "the locked-memory limit (ulimit -l, the container's memlock) or lower the "
                "activation volume (this warning is shown once)",
                RuntimeWarning,
                stacklevel=3,
            )
        logger.debug("pinning %d bytes failed, using pageable memory: %s", num_bytes, exc)
