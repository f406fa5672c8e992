"""Slab files of one SSD directory: preallocated once, carved into 4 KiB-aligned extents, reused.

Disk use is bounded by the peak of bytes held at once, not by the number of steps: a released
extent is handed out again to the next tensor. When no slab has room, one more is added (after
checking the free space): on demand, slabs double the capacity (from 4 MiB up to ``slab_bytes``
each), so the first step overshoots its peak by at most about 2x; :meth:`SlabDir.grow` (the
cache's ``reserve``) adds exactly the missing bytes. Slabs are deleted only on close.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any

from tba.errors import OffloadIOError
from tba.offloaders.extents import ExtentAllocator
from tba.offloaders.ssd._engine import IOEngine, io_error
from tba.offloaders.ssd._private_dir import PrivateDir
from tba.settings import SSD_MIN_GROW_BYTES

__all__ = ["Slab", "SlabDir", "free_disk_bytes"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20



def free_disk_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still allocate on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@dataclass(eq=False)
class Slab:
    """One preallocated file and the allocator over its bytes."""

    name: str
    path: str
    allocator: ExtentAllocator
    handle: Any  # the engine's open file
    # offset -> serial of the allocation holding it now. A token remembers its serial, so a
    # load or release through an extent that was freed and handed to another tensor is caught.
    owners: dict[int, int] = field(default_factory=dict)


class SlabDir:
    """The slabs of one private directory. Thread-safe.

    Args:
        private_dir: where the slab files live.
        engine: opens the files for I/O.
        slab_bytes: size of a regular slab (a larger request gets a slab of its own size).
        alignment: extent alignment (O_DIRECT needs 4 KiB).
    """

    def __init__(self, private_dir: PrivateDir, engine: IOEngine, slab_bytes: int, alignment: int) -> None:
        self.private_dir = private_dir
        self.path = private_dir.path
        self._engine = engine
        self._slab_bytes = slab_bytes
        self._alignment = alignment
        self._lock = threading.Lock()
        self._slabs: list[Slab] = []
        self._next_index = 0
        self._serials = itertools.count(1)

    @property
    def slab_names(self) -> list[str]:
        return [slab.name for slab in list(self._slabs)]

    @property
    def capacity_bytes(self) -> int:
        return sum(slab.allocator.capacity_bytes for slab in list(self._slabs))

    @property
    def used_bytes(self) -> int:
        return sum(slab.allocator.used_bytes for slab in list(self._slabs))

    def allocate(self, num_bytes: int) -> tuple[Slab, int, int]:
        """A slab, offset and allocation serial with ``num_bytes`` (rounded up) reserved.

        Raises:
            OffloadIOError: the directory needs a new slab and the filesystem cannot hold it.
        """
        with self._lock:
            for slab in self._slabs:
                offset = slab.allocator.allocate(num_bytes)
                if offset is not None:
                    return slab, offset, self._own(slab, offset)
            capacity = sum(s.allocator.capacity_bytes for s in self._slabs)
            target = min(self._slab_bytes, max(SSD_MIN_GROW_BYTES, capacity))
            slab = self._add_slab(max(num_bytes, target))
            offset = slab.allocator.allocate(num_bytes)
            assert offset is not None, "a fresh slab is at least as large as the request"
            return slab, offset, self._own(slab, offset)

    def _own(self, slab: Slab, offset: int) -> int:
        serial = next(self._serials)
        slab.owners[offset] = serial
        return serial

    @staticmethod
    def owns(slab: Slab, offset: int, serial: int) -> bool:
        """Whether the allocation ``serial`` still holds ``offset`` of ``slab``."""
        return slab.owners.get(offset) == serial

    def free(self, slab: Slab, offset: int, serial: int) -> None:
        """Give an extent back, unless it no longer belongs to allocation ``serial``."""
        with self._lock:
            if slab.owners.get(offset) != serial:
                logger.error(
                    "tba bug: release of %s offset %d by an allocation that no longer holds it; "
                    "left to its current holder", slab.path, offset,
                )
                return
            del slab.owners[offset]
            slab.allocator.free(offset)

    def shortfall(self, num_bytes: int) -> tuple[int, int]:
        """(bytes of new slabs needed so ``num_bytes`` fit in free slab space, free disk bytes)."""
        with self._lock:
            free_in_slabs = sum(s.allocator.capacity_bytes - s.allocator.used_bytes for s in self._slabs)
        missing = max(0, _round_up(num_bytes, self._alignment) - free_in_slabs)
        return _round_up(missing, _MiB), free_disk_bytes(self.path)

    def grow(self, num_bytes: int) -> None:
        """Add slabs until ``num_bytes`` of free slab space exist (preallocated on disk)."""
        with self._lock:
            free_in_slabs = sum(s.allocator.capacity_bytes - s.allocator.used_bytes for s in self._slabs)
            while free_in_slabs < num_bytes:
                slab = self._add_slab(min(self._slab_bytes, num_bytes - free_in_slabs))
                free_in_slabs += slab.allocator.capacity_bytes

    def _add_slab(self, num_bytes: int) -> Slab:
        """Create, preallocate and open one more slab of ``num_bytes`` (rounded up to 1 MiB). Lock held."""
        needed = _round_up(max(num_bytes, 1), self._alignment)
        size = _round_up(needed, _MiB)
        free = free_disk_bytes(self.path)
        if free < size:
            # Not room for the whole slab: one just large enough is still better than failing.
            size = needed
            if free < size:
                raise OffloadIOError(
                    f"SSD offload: not enough free space in {self.path} for {needed} more bytes of "
                    f"activations ({free} bytes free); free space on that drive, add directories "
                    "to ssd_dirs, or offload fewer tensors",
                    path=self.path,
                    num_bytes=size,
                    errno=errno.ENOSPC,
                )
        name = f"slab-{self._next_index}.bin"
        self._next_index += 1
        path = os.path.join(self.path, name)
        try:
            fd = self.private_dir.create(name)
        except OSError as e:
            raise io_error(
                "could not create a slab file", path=path, offset=0, num_bytes=size, errno_code=e.errno,
                detail=e.strerror or "",
            ) from e
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            handle = self._engine.open(self.private_dir.open_path(name), path)
        except OSError as e:
            self.private_dir.remove_file(name)
            raise io_error(
                "could not preallocate a slab file", path=path, offset=0, num_bytes=size,
                errno_code=e.errno, detail=e.strerror or "",
            ) from e
        except BaseException:
            self.private_dir.remove_file(name)
            raise
        slab = Slab(name, path, ExtentAllocator(size, self._alignment), handle)
        self._slabs.append(slab)
        return slab

    def close(self) -> None:
        """Close every slab's handle and delete the files and the directory. Idempotent."""
        with self._lock:
            slabs, self._slabs = self._slabs, []
        for slab in slabs:
            try:
                self._engine.close_file(slab.handle)
            except Exception:  # noqa: BLE001 - closing a handle must not stop the deletion
                pass
        self.private_dir.remove()

    def remove_now(self) -> None:
        """Signal/exit path: delete files and directory without closing descriptors or locking."""
        self.private_dir.remove(close_fds=False)
