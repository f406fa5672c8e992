"""The posix engine's staging buffers: a bounded set of reusable, pre-faulted, page-aligned host
buffers (pinned when CUDA is present) for the bytes that cannot move straight between a tensor
and a file."""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np
import torch

from tba.offloaders.host_memory import HostAllocator

__all__ = ["Staging", "StagingPool"]


@dataclass
class Staging:
    tensor: torch.Tensor  # chunk_bytes, 1-D uint8, page-aligned
    array: np.ndarray  # the same memory, for os.pwrite / os.preadv
    keepalive: object


class StagingPool:
    """At most ``max_buffers`` buffers of ``chunk_bytes``, made on first use and reused."""

    def __init__(self, chunk_bytes: int, max_buffers: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_buffers = max_buffers
        self._cond = threading.Condition()
        self._free: list[Staging] = []
        self._num_allocated = 0

    def _allocate(self) -> Staging:
        if torch.cuda.is_available():
            # Exactly chunk_bytes, page-aligned, pinned with cudaHostRegister (PyTorch's pinned
            # allocator would round chunk_bytes + alignment up to twice the size and keep it);
            # pageable with a one-time warning where pinning fails.
            buffer = HostAllocator().allocate(self.chunk_bytes, pinned=True)
            assert buffer.tensor is not None  # released only by clear()
            tensor = buffer.tensor
            keepalive: object = buffer
        else:
            keepalive = mmap.mmap(-1, self.chunk_bytes)
            tensor = torch.from_numpy(np.frombuffer(keepalive, dtype=np.uint8))
        tensor.zero_()  # pre-fault every page now, not during the first transfer
        return Staging(tensor, tensor.numpy(), keepalive)

    def acquire(self, block: bool) -> Staging | None:
        with self._cond:
            while True:
                if self._free:
                    return self._free.pop()
                if self._num_allocated < self.max_buffers:
                    self._num_allocated += 1
                    break
                if not block:
                    return None
                self._cond.wait()
        try:
            return self._allocate()
        except BaseException:
            with self._cond:
                self._num_allocated -= 1
                self._cond.notify()
            raise

    def release(self, staging: Staging) -> None:
        with self._cond:
            self._free.append(staging)
            self._cond.notify()

    def trim(self) -> None:
        """Free the buffers no transfer holds now (those in use stay); later calls to
        :meth:`acquire` make new ones."""
        with self._cond:
            free, self._free = self._free, []
            self._num_allocated -= len(free)
            self._cond.notify_all()
        _release(free)

    def clear(self) -> None:
        with self._cond:
            free, self._free = self._free, []
            self._num_allocated = 0
        _release(free)


def _release(buffers: list[Staging]) -> None:
    for staging in buffers:
        release = getattr(staging.keepalive, "release", None)
        if release is not None:
            release()  # a HostBuffer: unpin and unmap
