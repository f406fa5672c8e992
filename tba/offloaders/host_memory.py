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

Note [Pageable pool pages go back]
A pool keeps its slabs step after step, but the pages of a pageable slab that no stored tensor
uses are given back to the OS (``madvise(MADV_DONTNEED)``, Linux) as soon as they are free:
on CPU the pool lives in the same memory as the training, and pages kept after their extent
was released would count those bytes twice in the process's memory (once in the pool, once
again as the next step's activations waiting for their store). A page comes back zeroed at
its next write (a page fault: the price of not holding it). Pinned slabs keep their pages:
they are not the training device's memory, and unpinning and pinning again costs far more.
Tested in tests/offloaders/test_host.py::test_pageable_pool_gives_released_pages_back.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from tba.settings import PAGE_BYTES

__all__ = ["HostAllocator", "HostBuffer", "Pinner", "CudaHostRegister", "discard_pages"]

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


def _anonymous(num_bytes: int) -> mmap.mmap:
    """Private anonymous memory (as malloc's): ``MADV_DONTNEED`` frees its pages (a shared
    mapping, Python's default, would keep them in shared memory)."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:  # Windows: no flags
        return mmap.mmap(-1, num_bytes)
    return mmap.mmap(-1, num_bytes, flags=flags | mmap.MAP_ANONYMOUS)


_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_madvise: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def discard_pages(buffer: HostBuffer, start: int, stop: int) -> int:
    """Give back to the OS the whole pages of ``buffer`` inside bytes ``[start, stop)`` (Note
    [Pageable pool pages go back]): their content is lost, the next access finds zeros. Only
    for pageable buffers on Linux (elsewhere, and for pinned buffers, nothing happens); the
    caller makes sure no one uses those bytes. Returns the bytes given back."""
    global _madvise
    tensor = buffer.tensor
    if buffer.pinned or tensor is None or not sys.platform.startswith("linux"):
        return 0
    first = -(-start // PAGE_BYTES) * PAGE_BYTES  # buffers start on a page
    last = stop // PAGE_BYTES * PAGE_BYTES
    if last <= first:
        return 0
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    if _madvise(tensor.data_ptr() + first, last - first, _MADV_DONTNEED) != 0:
        logger.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())
        return 0
    return last - first


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
        mapping = _anonymous(mapped_bytes)
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
