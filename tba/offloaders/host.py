"""`HostOffloader`: activations into a reusable host-memory pool (pinned when CUDA is used)."""

from __future__ import annotations


import ctypes
import logging
import threading
import time

import torch

from tba.errors import TBAError
from tba.offloaders._stream_wait import wait_for_stream
from tba.offloaders.cpu_time import charge_pool_growth
from tba.offloaders.extents import ExtentAllocator
from tba.offloaders.host_memory import HostAllocator, HostBuffer, discard_pages
from tba.settings import HOST_POOL_ALIGNMENT, HOST_POOL_MIN_SLAB_BYTES, PAGE_BYTES

__all__ = ["HostOffloader"]

logger = logging.getLogger(__name__)



class _Slab:
    """One host buffer carved by an extent allocator."""

    __slots__ = ("buffer", "extents")

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer
        self.extents = ExtentAllocator(buffer.num_bytes, alignment=HOST_POOL_ALIGNMENT)


# A token: the slab, the offset in it and the byte count.
_Token = tuple[_Slab, int, int]


class HostOffloader:
    """Copies storages into slabs of host memory carved by an extent allocator.

    Pinning costs milliseconds per call, far too slow per tensor, so memory comes in large
    slabs that are reused step after step. CUDA sources go to pinned slabs (fast, asynchronous
    copies), CPU sources to pageable ones (CPU torch cannot pin). Slabs are exactly the size
    asked for and are pinned in place (Note [Pinned memory outside PyTorch's host allocator]
    in host_memory.py); when pinning fails the pool falls back to pageable memory and warns
    once.

    Note [Reserve off the training thread]: the pool grows (doubling) while the first steps
    run; the cache then reports the profiled peak (``reserve``, on its store worker, while
    other workers may be storing or loading), so ``reserve`` only records the size (under a
    lock that is never held while memory is allocated, pinned or copied). The next ``store`` that finds its pool
    empty, on a store worker thread, gives the old slabs back and allocates one slab of the
    reserved size; so the pool never holds old and new slabs at once.

    Args:
        pool_bytes: preallocate this much up front (per memory kind) instead of growing.
        max_pool_bytes: never hold more host memory than this (both memory kinds together,
            rounded up to 512 bytes): a store that finds no room within it raises ``TBAError``
            (:meth:`try_store` returns None instead). None: the pool grows as needed.
        allocator: where host memory comes from (tests inject one with a fake pinner).

    Example:
        >>> off = HostOffloader()
        >>> token = off.store(torch.arange(10, dtype=torch.uint8))
        >>> dst = torch.empty(10, dtype=torch.uint8); off.load(token, dst); off.release(token)
    """

    name = "host"

    def __init__(
        self, pool_bytes: int = 0, *, max_pool_bytes: int | None = None, allocator: HostAllocator | None = None
    ) -> None:
        problems = []
        if pool_bytes < 0:
            problems.append(f"pool_bytes must be >= 0, got {pool_bytes}")
        if max_pool_bytes is not None and max_pool_bytes <= 0:
            problems.append(f"max_pool_bytes must be None or > 0, got {max_pool_bytes}")
        if problems:
            raise ValueError("; ".join(problems))
        self._initial_bytes = pool_bytes
        self._max_bytes = None if max_pool_bytes is None else _aligned(max_pool_bytes)
        self._allocator = allocator if allocator is not None else HostAllocator()
        self._lock = threading.Lock()
        # One pool per memory kind wanted: pinned (for CUDA sources) and pageable (CPU sources).
        self._slabs: dict[bool, list[_Slab]] = {False: [], True: []}
        self._reserve_bytes: int | None = None  # recorded by reserve() ...
        self._reserve_pending: set[bool] = set()  # ... for these pools, not applied yet
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        """Bytes of host memory the pool holds now."""
        with self._lock:
            return sum(s.extents.capacity_bytes for slabs in self._slabs.values() for s in slabs)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.extents.used_bytes for slabs in self._slabs.values() for s in slabs)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory pinned (registered with CUDA) now."""
        return self._allocator.pinned_bytes

    @property
    def num_pin_failures(self) -> int:
        """Slabs that wanted pinned memory and got pageable memory instead."""
        return self._allocator.num_pin_failures

    def _new_slab(self, pinned: bool, num_bytes: int) -> _Slab:
        """A slab of ``num_bytes`` (no lock held: pinning takes milliseconds per MiB)."""
        start = time.perf_counter()
        buffer = self._allocator.allocate(num_bytes, pinned=pinned)
        charge_pool_growth(time.perf_counter() - start)  # Note [Pool growth is not transfer time]
        logger.debug("host pool: new %s slab of %d bytes", "pinned" if buffer.pinned else "pageable", num_bytes)
        return _Slab(buffer)

    def _take(self, pinned: bool, num_bytes: int) -> tuple[_Slab, int] | None:
        """An extent in a live slab of the ``pinned`` pool (lock held), or None."""
        if self._closed:
            raise RuntimeError("HostOffloader is closed")
        for slab in self._slabs[pinned]:
            offset = slab.extents.allocate(num_bytes)
            if offset is not None:
                return slab, offset
        return None

    def _allocate(self, pinned: bool, num_bytes: int) -> tuple[_Slab, int] | None:
        """An extent for ``num_bytes``, growing the pool if needed; None when ``max_pool_bytes``
        leaves no room for it."""
        retired: list[_Slab] = []
        with self._lock:
            slabs = self._slabs[pinned]
            reserve = self._reserve_bytes if pinned in self._reserve_pending else None
            if reserve is not None and not any(s.extents.num_allocations for s in slabs):
                # Note [Reserve off the training thread]: the pool is empty, resize it now.
                self._reserve_pending.discard(pinned)
                retired, slabs[:] = list(slabs), []
            else:
                reserve = None
                found = self._take(pinned, num_bytes)
                if found is not None:
                    return found
            capacity = sum(s.extents.capacity_bytes for s in slabs)
            everything = sum(s.extents.capacity_bytes for kind in self._slabs.values() for s in kind)
        for slab in retired:
            slab.buffer.release()
        if reserve is not None:
            want = max(num_bytes, reserve)
            logger.info("host pool sized to %d bytes from the profiled step", want)
        else:
            want = max(num_bytes, HOST_POOL_MIN_SLAB_BYTES, capacity, self._initial_bytes if not capacity else 0)
        want = _aligned(want)
        if self._max_bytes is not None:
            want = min(want, self._max_bytes - everything)
            if want < max(HOST_POOL_ALIGNMENT, _aligned(num_bytes)):
                return None
        slab = self._new_slab(pinned, want)
        with self._lock:
            if self._closed:
                slab.buffer.release()
                raise RuntimeError("HostOffloader is closed")
            capacity = sum(s.extents.capacity_bytes for kind in self._slabs.values() for s in kind)
            room = self._max_bytes is None or want <= self._max_bytes - capacity
            if room:
                self._slabs[pinned].append(slab)
            found = self._take(pinned, num_bytes)
        if not room:
            slab.buffer.release()  # another store grew the pool to max_pool_bytes meanwhile
        assert found is not None or not room
        return found

    def store(self, src: torch.Tensor) -> _Token:
        token = self.try_store(src)
        if token is None:
            raise TBAError(
                f"host pool full: {src.numel()} bytes do not fit in max_pool_bytes={self._max_bytes} "
                f"({self.used_bytes} bytes held); raise max_pool_bytes, offload less, or use "
                "offloader='host+ssd' to spill the rest to SSD"
            )
        return token

    def try_store(self, src: torch.Tensor) -> _Token | None:
        """Like :meth:`store`, but None (nothing copied) when ``max_pool_bytes`` leaves no room."""
        wants_pinned = src.device.type == "cuda"
        num_bytes = src.numel()
        found = self._allocate(wants_pinned, num_bytes)
        if found is None:
            return None
        slab, offset = found
        buffer = slab.buffer
        assert buffer.tensor is not None
        _copy(buffer.tensor[offset : offset + num_bytes], src, non_blocking=buffer.pinned)
        if buffer.pinned:
            wait_for_stream(src.device)
        return slab, offset, num_bytes

    def store_now(self, storage: torch.UntypedStorage) -> _Token | None:
        """Store a small CPU ``storage`` on the calling thread if the pageable pool has room
        without growing (Note [Small transfers inline] in tba/cache/engine/workers.py); None leaves
        it to ``store`` on a worker (no room, a reserve pending, or not a CPU storage)."""
        if storage.device.type != "cpu":
            return None
        num_bytes = storage.nbytes()
        with self._lock:
            if self._closed or False in self._reserve_pending:
                return None
            found = self._take(False, num_bytes)
        if found is None:
            return None
        slab, offset = found
        host = slab.buffer.tensor
        assert host is not None
        ctypes.memmove(host.data_ptr() + offset, storage.data_ptr(), num_bytes)
        return slab, offset, num_bytes

    def load(self, token: _Token, dst: torch.Tensor) -> None:
        slab, offset, num_bytes = token
        buffer = slab.buffer
        host = buffer.tensor
        if host is None:
            raise RuntimeError("HostOffloader: load of a token whose memory was released (closed)")
        if dst.device.type == "cpu" and not buffer.pinned:
            if dst.numel() != num_bytes:
                raise ValueError(f"HostOffloader: load of {num_bytes} bytes into {dst.numel()}")
            ctypes.memmove(dst.data_ptr(), host.data_ptr() + offset, num_bytes)
            return
        _copy(dst, host[offset : offset + num_bytes], non_blocking=buffer.pinned)
        if buffer.pinned and dst.device.type == "cuda":
            wait_for_stream(dst.device)

    def release(self, token: _Token) -> None:
        slab, offset, num_bytes = token
        with self._lock:
            if self._closed:
                return
            start, size = slab.extents.free(offset)
            if not slab.buffer.pinned:
                # Note [Pageable pool pages go back]: the pages the freed extent touches that are
                # now wholly free; under the lock, so no store is given them meanwhile.
                stop = offset + slab.extents.rounded(num_bytes)
                discard_pages(slab.buffer, max(start, offset - PAGE_BYTES + 1),
                              min(start + size, stop + PAGE_BYTES - 1))

    def reserve(self, num_bytes: int) -> None:
        """Size each pool to ``num_bytes`` (the profiled step's peak). Cheap and non-blocking:
        only records the size; see Note [Reserve off the training thread]. ``0``: nothing is
        offloaded for now: give back every slab that holds nothing (the next store allocates
        one of the size reserved before)."""
        if num_bytes <= 0:
            self._give_back_empty_slabs()
            return
        with self._lock:
            self._reserve_bytes = num_bytes
            for pinned, slabs in self._slabs.items():
                if not (len(slabs) == 1 and slabs[0].extents.capacity_bytes >= num_bytes):
                    self._reserve_pending.add(pinned)

    def _give_back_empty_slabs(self) -> None:
        with self._lock:
            empty = [s for slabs in self._slabs.values() for s in slabs if not s.extents.num_allocations]
            for pinned, slabs in self._slabs.items():
                slabs[:] = [s for s in slabs if s.extents.num_allocations]
                if self._reserve_bytes is not None and not slabs:
                    self._reserve_pending.add(pinned)  # regrow at the reserved size at once
        for slab in empty:
            slab.buffer.release()
        if empty:
            logger.debug("host pool: gave back %d empty slabs", len(empty))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            slabs = [s for kind in self._slabs.values() for s in kind]
            self._slabs = {False: [], True: []}
        for slab in slabs:
            slab.buffer.release()


def _aligned(num_bytes: int) -> int:
    return (num_bytes + HOST_POOL_ALIGNMENT - 1) // HOST_POOL_ALIGNMENT * HOST_POOL_ALIGNMENT


def _copy(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
    """Byte copy of contiguous uint8 tensors; host-to-host is a plain ``memmove`` (torch's
    uint8 ``copy_`` measured ~1.6x slower on the 2-core development machines, and building
    numpy views costs microseconds per call)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if dst.numel() != src.numel():
            raise ValueError(f"byte copy of {src.numel()} bytes into {dst.numel()}")
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src, non_blocking=non_blocking)
