"""Exceptions raised by tba."""

from __future__ import annotations

import os

__all__ = ["TBAError", "OffloadIOError"]


class TBAError(RuntimeError):
    """Base class of every error tba raises on purpose."""


class OffloadIOError(TBAError):
    """A store or load of an activation failed.

    Raised on the training thread (at the next hook or at the end of the step), never swallowed:
    an I/O failure must never turn into a wrong gradient.

    Attributes:
        path: file (or pool) the transfer went to, if any.
        offset: byte offset inside ``path``.
        num_bytes: bytes the transfer should have moved.
        errno: the OS error number, if the failure came from the kernel.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        num_bytes: int | None = None,
        errno: int | None = None,
    ) -> None:
        self.path = path
        self.offset = offset
        self.num_bytes = num_bytes
        self.errno = errno
        details = []
        if path is not None:
            details.append(f"path={path}")
        if offset is not None:
            details.append(f"offset={offset}")
        if num_bytes is not None:
            details.append(f"bytes={num_bytes}")
        if errno is not None:
            details.append(f"errno={errno} ({os.strerror(errno)})")
        super().__init__(f"{message} [{', '.join(details)}]" if details else message)
