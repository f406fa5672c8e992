"""Where gpu_truth.py reads memory from: the CUDA caching allocator (tba.rok's
``CudaMemoryStats``), or on CPU (tiny mode) a stand-in with the same interface
(``tba.rok._allocator.MemoryStats``) reading the process's resident set; both from outside
tba's cache.

The script takes ``peak_allocated_bytes() - allocated_bytes()`` read just before a step
(everything persistent: weights, gradients, optimizer state of every live model) as the step's
activation peak.
"""

from __future__ import annotations

from tba.rok._allocator import CudaMemoryStats, MemoryStats

__all__ = ["CudaMemoryStats", "MemoryStats", "ProcessHeap", "describe_source"]


def describe_source(stats: MemoryStats) -> str:
    """One line for the summary: what the memory columns were read from."""
    if isinstance(stats, ProcessHeap):
        return stats.source
    return (f"{stats.name}: torch.cuda.reset_peak_memory_stats() before each step, max_memory_allocated() "
            "after it, minus memory_allocated() before it")


class ProcessHeap:
    """CPU stand-in: process RSS and its high-water mark (reset through /proc/self/clear_refs),
    with glibc returning every freed block above ``mmap_threshold_bytes`` to the OS at once so
    that RSS follows live tensors (tba.rok's method). The host offloader's pool is process
    memory too, so on CPU it cannot lower this figure: tiny mode checks the code path, not
    the targets."""

    name = "process RSS high-water mark (CPU stand-in)"

    def __init__(self, mmap_threshold_bytes: int = 64 << 10) -> None:
        from tba.rok._rss import RSS, configure_malloc

        malloc = configure_malloc(mmap_threshold_bytes)
        self._rss = RSS()
        self.source = f"CPU stand-in: process RSS high-water ({self._rss.method}; malloc {malloc})"

    def synchronize(self) -> None:
        pass

    def reset_peak(self) -> None:
        self._rss.reset_peak()

    def allocated_bytes(self) -> int:
        return self._rss.current()

    def reserved_bytes(self) -> int:
        return self._rss.current()

    def peak_allocated_bytes(self) -> int:
        return max(self._rss.peak(), self._rss.current())

    def peak_reserved_bytes(self) -> int:
        return self.peak_allocated_bytes()
