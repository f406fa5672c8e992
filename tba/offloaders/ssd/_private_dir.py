"""The per-process private directory of the SSD offloader, held open from creation to removal.

Layout: ``<parent>/tba-ssd-<host>-<pid>-r<rank>-<random>/`` (mode 0700) holding the marker file
``tba-owner.json`` and the slab files ``slab-<n>.bin``. The marker records host, pid and the
process start time, and stays ``flock``-ed by its process for as long as the directory is in use
(``_stale_dirs`` reads it to remove directories of dead processes).

Note [Removing only what we created]: where the parent is writable by others without the sticky
bit, another user can rename our directory away and put a symlink to one of their directories
(or one of ours) in its place; a removal by path would then delete files there. So the directory
is opened (``O_NOFOLLOW``) right after ``mkdir`` and that handle is used for everything after:
files are created, opened (through ``/proc/self/fd/<fd>/``) and unlinked relative to it, so they
are always ours wherever the directory went. Each file's (device, inode) is recorded when
created and checked before it is unlinked, and the directory itself is removed from the parent
(also held open) only if the name still leads to the directory we created, without following a
symlink. A directory renamed away is emptied and left where it went, with a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import warnings

__all__ = ["PREFIX", "MARKER_NAME", "PrivateDir", "is_slab_name", "host_name", "start_time_of"]

logger = logging.getLogger(__name__)

PREFIX = "tba-ssd-"
MARKER_NAME = "tba-owner.json"
MARKER_TOOL = "tba-ssd-offloader"
_SLAB_RE = re.compile(r"slab-\d+\.bin")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PROC_FD = "/proc/self/fd"


def is_slab_name(name: str) -> bool:
    """Whether ``name`` is a slab file name this package creates."""
    return _SLAB_RE.fullmatch(name) is not None


def host_name() -> str:
    return socket.gethostname()


def start_time_of(pid: int) -> float | None:
    """Start time of process ``pid`` (seconds since the epoch); None if unreadable or gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


_warned_lock = threading.Lock()
_warned_parents: set[str] = set()


def _warn_if_shared(parent: str, mode: int) -> None:
    """Warn once per parent that others can write to it without the sticky bit."""
    writers = [who for who, bit in (("other users", stat.S_IWOTH), ("its group", stat.S_IWGRP)) if mode & bit]
    if not writers or mode & stat.S_ISVTX:
        return
    with _warned_lock:
        if parent in _warned_parents:
            return
        _warned_parents.add(parent)
    warnings.warn(
        f"tba: the SSD offload directory {parent!r} is writable by {' and '.join(writers)} without "
        "the sticky bit, so they can rename or replace tba's private directory in it. tba still "
        "removes only files it created (see docs/ssd.md), but activations may be left on disk or "
        "offloading may fail; use a directory only you can write to, or set the sticky bit "
        "(chmod +t)",
        RuntimeWarning,
        stacklevel=4,
    )


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class PrivateDir:
    """Creates ``<parent>/tba-ssd-...`` with its locked marker; removes what it created on demand.

    Raises:
        ValueError: ``parent`` is missing, not a directory, or not writable.
    """

    def __init__(self, parent: str, rank: int | None) -> None:
        parent = os.path.abspath(os.path.expanduser(parent))
        if not os.path.isdir(parent):
            what = "does not exist" if not os.path.lexists(parent) else "is not a directory"
            raise ValueError(
                f"SSD offload directory {parent!r} {what}; create it (mkdir -p) or pass an "
                "existing directory in ssd_dirs / TBA_SSD_DIR"
            )
        self.parent = parent
        safe_host = re.sub(r"[^A-Za-z0-9_.]", "_", host_name())[:64] or "host"
        rank_part = "x" if rank is None else str(rank)
        self.name = f"{PREFIX}{safe_host}-{os.getpid()}-r{rank_part}-{secrets.token_hex(4)}"
        self.path = os.path.join(parent, self.name)
        self._created: dict[str, tuple[int, int]] = {}  # file name -> (device, inode)
        self._marker_fd = self._fd = -1
        self._dir_identity = (-1, -1)
        self._parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _warn_if_shared(parent, os.fstat(self._parent_fd).st_mode)
            os.mkdir(self.name, 0o700, dir_fd=self._parent_fd)
        except OSError as e:
            os.close(self._parent_fd)
            raise ValueError(
                f"cannot create the SSD offload directory {self.path!r}: {e.strerror} "
                f"(errno {e.errno}); pass a writable directory in ssd_dirs / TBA_SSD_DIR"
            ) from e
        try:
            self._fd = os.open(self.name, _DIR_FLAGS, dir_fd=self._parent_fd)
            st = os.fstat(self._fd)
            if st.st_uid != os.geteuid():
                raise OSError(0, f"{self.path} was replaced by a directory of uid {st.st_uid} right after mkdir")
            self._dir_identity = _identity(st)
            os.fchmod(self._fd, 0o700)
            self._marker_fd = self._write_marker(rank)
        except OSError as e:
            if self._fd < 0:
                try:  # could not even open what we just made: remove it if it is an empty directory
                    os.rmdir(self.name, dir_fd=self._parent_fd)
                except OSError:
                    pass
            self.remove()
            raise ValueError(
                f"cannot write to the SSD offload directory {self.path!r}: {e.strerror} "
                f"(errno {e.errno}); pass a writable directory in ssd_dirs / TBA_SSD_DIR"
            ) from e

    def create(self, name: str) -> int:
        """Create the new file ``name`` (mode 0600) in the directory; return its open fd."""
        fd = os.open(
            name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd
        )
        self._created[name] = _identity(os.fstat(fd))
        return fd

    def remove_file(self, name: str) -> None:
        """Delete the file ``name`` this object created (a slab that could not be set up)."""
        identity = self._created.get(name)
        if identity is not None:
            self._unlink(name, identity)

    def open_path(self, name: str) -> str:
        """A path to the file ``name`` that resolves through the held directory handle, for
        engines that open files by path (kvikio), so the file opened is ours."""
        if os.path.isdir(_PROC_FD):
            return f"{_PROC_FD}/{self._fd}/{name}"
        # No /proc (not Linux): the plain path, after checking the name still leads to our directory.
        st = os.stat(self.name, dir_fd=self._parent_fd, follow_symlinks=False)
        if _identity(st) != self._dir_identity:
            raise OSError(0, f"{self.path} is no longer the directory tba created")
        return os.path.join(self.path, name)

    def _write_marker(self, rank: int | None) -> int:
        fd = self.create(MARKER_NAME)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                # Some network filesystems have no locks: the pid check alone guards the dir.
                logger.debug("tba: cannot lock %s (%s); stale-directory checks use the pid only", self.path, e)
            record = {
                "tool": MARKER_TOOL,
                "host": host_name(),
                "pid": os.getpid(),
                "start_time": start_time_of(os.getpid()),
                "rank": rank,
            }
            os.write(fd, json.dumps(record).encode())
        except OSError:
            os.close(fd)
            raise
        return fd

    def remove(self, close_fds: bool = True) -> None:
        """Delete the files this object created, then the directory. Never raises.

        With ``close_fds=False`` (signal and exit paths) no file descriptor is closed, so
        threads still doing I/O cannot have a descriptor number reused under them.
        """
        if self._fd >= 0:
            for name, identity in list(self._created.items()):
                self._unlink(name, identity)
            self._rmdir()
        if close_fds:
            for attribute in ("_marker_fd", "_fd", "_parent_fd"):
                fd = getattr(self, attribute)
                if fd >= 0:
                    os.close(fd)
                    setattr(self, attribute, -1)

    def _unlink(self, name: str, identity: tuple[int, int]) -> None:
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            if _identity(st) != identity:
                logger.warning("tba: left %s/%s in place: it is not the file tba created", self.path, name)
                return
            os.unlink(name, dir_fd=self._fd)
            self._created.pop(name, None)
        except FileNotFoundError:
            self._created.pop(name, None)
        except OSError as e:
            logger.warning("tba: could not delete %s: %s", os.path.join(self.path, name), e)

    def _rmdir(self) -> None:
        try:
            st = os.stat(self.name, dir_fd=self._parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as e:
            logger.warning("tba: left the SSD offload directory %s in place: %s", self.path, e)
            return
        if st is None or _identity(st) != self._dir_identity:
            if st is not None or os.fstat(self._fd).st_nlink > 0:
                logger.warning(
                    "tba: the SSD offload directory %s was moved or replaced by someone else; tba "
                    "emptied the directory it created (wherever it is now) and left %s untouched",
                    self.path,
                    self.path,
                )
            return
        try:
            os.rmdir(self.name, dir_fd=self._parent_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning(
                "tba: left the SSD offload directory %s in place (%s): it holds files tba did not "
                "create; remove it by hand",
                self.path,
                e.strerror,
            )
