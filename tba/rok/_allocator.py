"""The activation peak from the device's allocator, and where tba's accounting disagrees with it
(private module of :mod:`tba.rok`).

Note [The allocator is the activation axis on CUDA]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What a GPU user buys tba for is a lower peak of the memory PyTorch allocates in a step, not a
lower count in tba's own books. On a device with an allocator the sweep's x-axis is therefore
the allocator's, for every strategy alike: ``reset_peak_memory_stats()`` before each measured
step, ``max_memory_allocated()`` after it (the device synchronised), minus
``memory_allocated()`` after set-up (weights, gradients, optimizer state); the maximum over the
measured steps. It includes the step's temporaries (logits, gradient buffers of backward), so
keep's allocator peak is above its saved activations.

tba's accounting (the cache's ``peak_resident_bytes``; for keep and the checkpointing
strategies the saved-activation meter, Note [One measure of activation memory] in ``_saved``)
stays beside it as ``counted_activation_peak_bytes``. Where the two differ by more than
``TOLERANCE`` of the allocator's figure, the summary and the figure say so: either the step's
temporaries dominate, or tba's books miss memory the device still holds (a storage kept alive
after its store, a copy in flight) and the allocator's number is the one to believe.

On CPU there is no allocator with a resettable peak: the x-axis stays the accounting (and RSS
beside it). The code choosing and reading the source takes a :class:`MemoryStats`, so its
tests inject a fake one on the CPU.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["TOLERANCE", "CudaMemoryStats", "MemoryStats", "accounting_gap", "activation_columns",
           "memory_stats_for"]

TOLERANCE = 0.10


class MemoryStats(Protocol):
    """A device allocator's statistics, as the sweep reads them."""

    name: str  # how the figures name the source, e.g. "torch.cuda.max_memory_allocated"

    def synchronize(self) -> None:
        """Wait for the device's queued work (a peak read before it would miss its end)."""

    def allocated_bytes(self) -> int:
        """Bytes allocated now."""

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds now (allocated and cached)."""

    def reset_peak(self) -> None:
        """Start the peaks over from what is allocated and reserved now."""

    def peak_allocated_bytes(self) -> int:
        """The most bytes allocated at once since the last reset."""

    def peak_reserved_bytes(self) -> int:
        """The most bytes reserved at once since the last reset."""


class CudaMemoryStats:
    """PyTorch's CUDA caching allocator (the current device). Touches CUDA only when read."""

    name = "torch.cuda.max_memory_allocated"

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def allocated_bytes(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated())

    def reserved_bytes(self) -> int:
        import torch

        return int(torch.cuda.memory_reserved())

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak_allocated_bytes(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated())

    def peak_reserved_bytes(self) -> int:
        import torch

        return int(torch.cuda.max_memory_reserved())


def memory_stats_for(device: str) -> MemoryStats | None:
    """The allocator the sweep reads on ``device`` (None: none; the CPU)."""
    return CudaMemoryStats() if device == "cuda" else None


def activation_columns(counted_bytes: int | None, counted_source: str,
                       allocator_bytes: int | None) -> dict[str, Any]:
    """A sample's activation-peak columns: the x-axis (``activation_peak_bytes`` and its
    source: the allocator's where there is one, else tba's accounting) and the accounting
    beside it, with their ratio.

    Example:
        >>> activation_columns(900, "cache", 1000)["activation_peak_source"]
        'allocator'
        >>> activation_columns(900, "meter", None)["activation_peak_bytes"]
        900
    """
    row: dict[str, Any] = {"counted_activation_peak_bytes": counted_bytes,
                           "counted_activation_peak_source": counted_source}
    if allocator_bytes is None:
        row.update(activation_peak_bytes=counted_bytes, activation_peak_source=counted_source)
        return row
    row.update(activation_peak_bytes=allocator_bytes, activation_peak_source="allocator")
    if counted_bytes is not None and allocator_bytes > 0:
        row["counted_vs_allocator"] = counted_bytes / allocator_bytes
    return row


def accounting_gap(point: dict[str, Any], tolerance: float = TOLERANCE) -> str | None:
    """Why ``point``'s allocator peak and tba's accounting differ by more than ``tolerance``
    of the allocator's (None where they agree or the axis is not the allocator's).

    Example:
        >>> accounting_gap({"strategy": "offload-host", "batch_size": 8, "activation_peak_source": "allocator",
        ...                 "activation_peak_bytes": 2**30, "counted_activation_peak_bytes": 2**29,
        ...                 "counted_activation_peak_source": "cache"})
        'offload-host b=8: allocator 1024.0 MiB, cache accounting 512.0 MiB (0.50x the allocator)'
    """
    if point.get("activation_peak_source") != "allocator":
        return None
    allocator, counted = point.get("activation_peak_bytes"), point.get("counted_activation_peak_bytes")
    if allocator is None or counted is None:
        return None
    head = f"{point['strategy']} b={point['batch_size']}: allocator {allocator / 2**20:.1f} MiB"
    source = point.get("counted_activation_peak_source", "tba")
    if allocator <= 0:
        return f"{head} (no growth over set-up), {source} accounting {counted / 2**20:.1f} MiB"
    ratio = counted / allocator
    if abs(ratio - 1.0) <= tolerance:
        return None
    return f"{head}, {source} accounting {counted / 2**20:.1f} MiB ({ratio:.2f}x the allocator)"
