"""Process and device memory as the ROK sweep measures it beside the activation peak (private
module of :mod:`tba.rok`).

RSS and its resettable high-water mark, the glibc settings that make RSS follow live memory
(see the docstring of :mod:`tba.rok`), and what a step adds to them and, where the device has
an allocator (CUDA), to its allocated and reserved memory (Note [The allocator is the activation
axis on CUDA] in ``_allocator``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tba.rok._allocator import MemoryStats

__all__ = ["RSS", "StepMemory", "configure_malloc"]

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def configure_malloc(mmap_threshold_bytes: int | None) -> str:
    """Make glibc return big frees to the OS at once, so RSS follows live memory.

    Allocations above the mmap threshold get their own mapping, unmapped on free; a fixed
    threshold also stops glibc from raising it dynamically after the first big free. The same
    values are exported as ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` for the
    forkserver; ``mallopt`` here makes sure they hold in this process.
    """
    if mmap_threshold_bytes is None or platform.system() != "Linux":
        return "default"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, int(mmap_threshold_bytes)) == 1
    except OSError as e:  # not glibc
        return f"default (mallopt unavailable: {e})"
    return f"mmap/trim threshold {mmap_threshold_bytes} B" if ok else "default (mallopt refused)"


class RSS:
    """Process RSS and its high-water mark, resettable through ``/proc/self/clear_refs``."""

    def __init__(self) -> None:
        self.page_bytes = os.sysconf("SC_PAGE_SIZE")
        self.can_reset = self._try_reset()
        self.method = ("VmHWM after clear_refs=5" if self.can_reset else "ru_maxrss (process lifetime)")

    @staticmethod
    def _try_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return RSS._status_kib("VmHWM") is not None
        except OSError:
            return False

    @staticmethod
    def _status_kib(key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def current(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page_bytes
        except OSError:
            import psutil

            return psutil.Process().memory_info().rss

    def reset_peak(self) -> None:
        if self.can_reset:
            self._try_reset()

    def peak(self) -> int:
        if self.can_reset:
            kib = self._status_kib("VmHWM")
            assert kib is not None, "tba bug: can_reset means /proc/self/status has VmHWM"
            return kib * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class StepMemory:
    """What each training step adds to the memory held after set-up (weights, gradients and
    optimizer state): process RSS (high-water mark during the step minus RSS after set-up),
    and where the device has an allocator (``device``: :class:`~tba.rok._allocator.MemoryStats`)
    its peak allocated and reserved bytes during the step minus their values after set-up.
    ``start`` before a step, ``finish`` after it; the maximum over the steps finished is kept
    (and the allocator's per step)."""

    def __init__(self, device: MemoryStats | None) -> None:
        self.device = device
        self.rss = RSS()
        self.baseline: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.allocated_per_step: list[int] = []
        self._before = 0

    def take_baseline(self) -> None:
        self.baseline = {"rss": self.rss.current()}
        if self.device is not None:
            self.device.synchronize()
            self.baseline.update(allocated=self.device.allocated_bytes(), reserved=self.device.reserved_bytes())

    def start(self) -> None:
        self._before = self.rss.current()
        self.rss.reset_peak()
        if self.device is not None:
            self.device.synchronize()
            self.device.reset_peak()

    def finish(self) -> None:
        """After the step (its device work synchronised here first)."""
        if self.device is not None:
            self.device.synchronize()
        peak = self.rss.peak()
        found = {"process_rss_peak_bytes": peak - self.baseline["rss"], "process_rss_step_delta_bytes": peak - self._before}
        if self.device is not None:
            allocated = self.device.peak_allocated_bytes() - self.baseline["allocated"]
            self.allocated_per_step.append(allocated)
            found["cuda_max_allocated_delta_bytes"] = allocated
            found["cuda_max_reserved_delta_bytes"] = self.device.peak_reserved_bytes() - self.baseline["reserved"]
        for key, value in found.items():
            self.peaks[key] = max(value, self.peaks.get(key, value))

    @property
    def allocator_peak(self) -> int | None:
        """The allocator's activation peak: the most a measured step allocated over set-up
        (None without an allocator or before a step finished)."""
        return self.peaks.get("cuda_max_allocated_delta_bytes")

    def row(self) -> dict[str, Any]:
        """The columns: the peaks, the baseline and how RSS was read."""
        out: dict[str, Any] = {**self.peaks, "process_rss_after_setup_bytes": self.baseline["rss"],
                               "process_rss_method": f"RSS high-water ({self.rss.method}) - RSS after set-up"}
        if self.device is not None:
            out["allocator_activation_peak_per_step"] = list(self.allocated_per_step)
            out["allocator_source"] = f"{self.device.name} in a step - memory_allocated after set-up"
        return out
