"""Where gpu_truth.py reads memory from: the CUDA caching allocator, or on CPU (tiny mode) the
process's resident set, both measured from outside tba's cache.

A provider has ``sync()``, ``reset_peak()``, ``current_bytes()`` and ``peak_bytes()`` (the
most bytes held since ``reset_peak``) and a ``source`` line for the summary. The script takes
``peak_bytes() - current_bytes()`` read just before a step (everything persistent: weights,
gradients, optimizer state of every live model) as the step's activation peak.
"""

from __future__ import annotations

from typing import Protocol


class MemoryStats(Protocol):
    source: str

    def sync(self) -> None: ...

    def reset_peak(self) -> None: ...

    def current_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...


class CudaAllocator:
    """``torch.cuda.memory_allocated`` and ``max_memory_allocated`` (reset by
    ``reset_peak_memory_stats``): the bytes of live tensors, whoever allocated them."""

    source = ("CUDA caching allocator: torch.cuda.reset_peak_memory_stats() before each step, "
              "max_memory_allocated() after it, minus memory_allocated() before it")

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda

    def sync(self) -> None:
        self._cuda.synchronize()

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats()

    def current_bytes(self) -> int:
        return int(self._cuda.memory_allocated())

    def peak_bytes(self) -> int:
        return int(self._cuda.max_memory_allocated())


class ProcessHeap:
    """CPU stand-in: process RSS and its high-water mark (reset through /proc/self/clear_refs),
    with glibc returning every freed block above ``mmap_threshold_bytes`` to the OS at once so
    that RSS follows live tensors (tba.rok's method). The host offloader's pool is process
    memory too, so on CPU it cannot lower this figure: tiny mode checks the code path, not
    the targets."""

    def __init__(self, mmap_threshold_bytes: int = 64 << 10) -> None:
        from tba.rok._rss import RSS, configure_malloc

        malloc = configure_malloc(mmap_threshold_bytes)
        self._rss = RSS()
        self.source = f"CPU stand-in: process RSS high-water ({self._rss.method}; malloc {malloc})"

    def sync(self) -> None:
        pass

    def reset_peak(self) -> None:
        self._rss.reset_peak()

    def current_bytes(self) -> int:
        return self._rss.current()

    def peak_bytes(self) -> int:
        return max(self._rss.peak(), self._rss.current())
