"""First-fit extent allocator over one contiguous byte range (a pool slab or a slab file)."""

from __future__ import annotations

import bisect
import threading

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Hands out aligned byte ranges of a fixed-capacity region and takes them back.

    Free ranges are kept sorted by offset and coalesced on free, so space is reused step after
    step and the footprint is bounded by the peak of what is held at once. Thread-safe.

    Example:
        >>> a = ExtentAllocator(1 << 20, alignment=4096)
        >>> off = a.allocate(5000)   # 8192 bytes reserved at offset 0
        >>> a.free(off)              # the free range it joined: all of it
        (0, 1048576)
    """

    def __init__(self, capacity_bytes: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0] if self.capacity_bytes else []
        self._free_sizes: dict[int, int] = {0: self.capacity_bytes} if self.capacity_bytes else {}
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    def rounded(self, num_bytes: int) -> int:
        """Bytes actually reserved for a request of ``num_bytes`` (at least one alignment unit)."""
        a = self.alignment
        return max(a, (num_bytes + a - 1) // a * a)

    def allocate(self, num_bytes: int) -> int | None:
        """Offset of a free range of ``num_bytes`` (rounded up), or None if none is large enough."""
        size = self.rounded(num_bytes)
        with self._lock:
            for i, start in enumerate(self._free_starts):
                free = self._free_sizes[start]
                if free < size:
                    continue
                del self._free_sizes[start]
                if free == size:
                    del self._free_starts[i]
                else:
                    self._free_starts[i] = start + size
                    self._free_sizes[start + size] = free - size
                self._used[start] = size
                self.used_bytes += size
                return start
        return None

    def free(self, offset: int) -> tuple[int, int]:
        """Give back the range that ``allocate`` returned at ``offset``; returns the free range
        ``(offset, size)`` it is now part of (coalesced with its free neighbours)."""
        with self._lock:
            size = self._used.pop(offset, None)
            assert size is not None, f"double free or foreign offset {offset}"
            self.used_bytes -= size
            i = bisect.bisect_left(self._free_starts, offset)
            # Coalesce with the following free range.
            if i < len(self._free_starts) and self._free_starts[i] == offset + size:
                size += self._free_sizes.pop(self._free_starts[i])
                del self._free_starts[i]
            # Coalesce with the preceding free range.
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_sizes[prev] == offset:
                    self._free_sizes[prev] += size
                    return prev, self._free_sizes[prev]
            self._free_starts.insert(i, offset)
            self._free_sizes[offset] = size
            return offset, size

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            return max(self._free_sizes.values(), default=0)

    @property
    def num_allocations(self) -> int:
        with self._lock:
            return len(self._used)
