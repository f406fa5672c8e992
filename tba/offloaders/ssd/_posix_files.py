"""Slab files as the posix engine opens them: buffered and, where the filesystem allows it,
with O_DIRECT; and the one-time notices about falling back to buffered I/O."""

from __future__ import annotations

import logging
import os
import threading

from tba.settings import DIRECT_IO_ALIGNMENT

__all__ = ["ALIGNMENT", "PosixFile", "notice_once"]

logger = logging.getLogger("tba.offloaders.ssd._posix")

ALIGNMENT = DIRECT_IO_ALIGNMENT  # O_DIRECT address, offset and length alignment we keep to

_notice_lock = threading.Lock()
_noticed: set[str] = set()


def notice_once(key: str, message: str, *args: object) -> None:
    with _notice_lock:
        if key in _noticed:
            return
        _noticed.add(key)
    logger.warning(message, *args)


class PosixFile:
    """A slab file opened buffered and, where allowed, with O_DIRECT."""

    def __init__(self, path: str, label: str) -> None:
        self.path = label  # named in errors and notices; ``path`` may go through /proc/self/fd
        self._lock = threading.Lock()
        self._retired: list[int] = []
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(path, flags)
        self.direct_fd: int | None = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                notice_once(
                    f"open:{os.path.dirname(label)}",
                    "tba SSD offloader: the filesystem of %s refuses O_DIRECT (%s); using buffered "
                    "I/O through the page cache, which costs memory bandwidth and host memory",
                    os.path.dirname(label),
                    e.strerror,
                )

    def drop_direct(self, reason: str) -> None:
        """Stop using O_DIRECT for this file (the filesystem rejected an O_DIRECT transfer)."""
        with self._lock:
            if self.direct_fd is None:
                return
            # Left open: another thread may be using it right now. Closed with the file.
            self._retired.append(self.direct_fd)
            self.direct_fd = None
        notice_once(
            f"io:{os.path.dirname(self.path)}",
            "tba SSD offloader: O_DIRECT I/O on %s failed (%s); using buffered I/O for this file",
            self.path,
            reason,
        )

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd, *self._retired):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None
        self._retired.clear()
