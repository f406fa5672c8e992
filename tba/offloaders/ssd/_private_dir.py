"""The per-process private directory of the SSD offloader, and removal of ones left by dead processes.

Layout: ``<parent>/tba-ssd-<host>-<pid>-r<rank>-<random>/`` (mode 0700) holding the marker file
``tba-owner.json`` and the slab files ``slab-<n>.bin``. The marker records host, pid and the
process start time, and stays ``flock``-ed by its process for as long as the directory is in use.
A directory is removed at start-up only if all of these hold: the name has our prefix, it is a
real directory owned by our uid, its marker parses and names this host, its pid is gone (or now
belongs to a younger process), and the marker's lock can be taken. Only the marker and files
named like slabs are deleted; anything else keeps the directory in place.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket

__all__ = ["PREFIX", "MARKER_NAME", "PrivateDir", "remove_stale_dirs", "is_slab_name"]

logger = logging.getLogger(__name__)

PREFIX = "tba-ssd-"
MARKER_NAME = "tba-owner.json"
_MARKER_TOOL = "tba-ssd-offloader"
_SLAB_RE = re.compile(r"slab-\d+\.bin")


def is_slab_name(name: str) -> bool:
    """Whether ``name`` is a slab file name this package creates."""
    return _SLAB_RE.fullmatch(name) is not None


def _host() -> str:
    return socket.gethostname()


def _start_time(pid: int) -> float | None:
    """Start time of process ``pid`` (seconds since the epoch), or None if there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        # Exists but unreadable (another user's process): treat as alive.
        return float("nan")


class PrivateDir:
    """Creates ``<parent>/tba-ssd-...`` with its locked marker; removes it again on demand.

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
        safe_host = re.sub(r"[^A-Za-z0-9_.]", "_", _host())[:64] or "host"
        rank_part = "x" if rank is None else str(rank)
        name = f"{PREFIX}{safe_host}-{os.getpid()}-r{rank_part}-{secrets.token_hex(4)}"
        self.path = os.path.join(parent, name)
        try:
            os.mkdir(self.path, 0o700)
        except OSError as e:
            raise ValueError(
                f"cannot create the SSD offload directory {self.path!r}: {e.strerror} "
                f"(errno {e.errno}); pass a writable directory in ssd_dirs / TBA_SSD_DIR"
            ) from e
        try:
            os.chmod(self.path, 0o700)
            self._marker_fd = self._write_marker(rank)
        except OSError as e:
            try:
                os.unlink(os.path.join(self.path, MARKER_NAME))
            except OSError:
                pass
            self._rmdir_quietly()
            raise ValueError(
                f"cannot write to the SSD offload directory {self.path!r}: {e.strerror} "
                f"(errno {e.errno}); pass a writable directory in ssd_dirs / TBA_SSD_DIR"
            ) from e
        self.parent = parent

    def _write_marker(self, rank: int | None) -> int:
        marker = os.path.join(self.path, MARKER_NAME)
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                # Some network filesystems have no locks: the pid check alone guards the dir.
                logger.debug("tba: cannot lock %s (%s); stale-directory checks use the pid only", marker, e)
            record = {
                "tool": _MARKER_TOOL,
                "host": _host(),
                "pid": os.getpid(),
                "start_time": _start_time(os.getpid()),
                "rank": rank,
            }
            os.write(fd, json.dumps(record).encode())
        except OSError:
            os.close(fd)
            raise
        return fd

    def remove(self, slab_names: list[str], close_marker: bool = True) -> None:
        """Delete the given slab files, the marker and the directory. Never raises.

        With ``close_marker=False`` (signal and exit paths) no file descriptor is closed, so
        threads still doing I/O cannot have a descriptor number reused under them.
        """
        for name in [*slab_names, MARKER_NAME]:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("tba: could not delete %s: %s", os.path.join(self.path, name), e)
        if close_marker and self._marker_fd >= 0:
            os.close(self._marker_fd)
            self._marker_fd = -1
        self._rmdir_quietly()

    def _rmdir_quietly(self) -> None:
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning(
                "tba: left the SSD offload directory %s in place (%s): it holds files tba did not "
                "create; remove it by hand",
                self.path,
                e.strerror,
            )


def remove_stale_dirs(parent: str) -> list[str]:
    """Remove directories under ``parent`` left by dead tba processes of this host.

    Returns the paths removed. Never raises for a directory it cannot inspect: it skips it.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            if _remove_if_stale(entry.path):
                removed.append(entry.path)
        except OSError as e:
            logger.debug("tba: skipped %s while looking for stale SSD directories: %s", entry.path, e)
    if removed:
        logger.info("tba: removed %d SSD offload directories left by dead processes: %s", len(removed), removed)
    return removed


def _remove_if_stale(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, MARKER_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no marker we wrote: not ours
    try:
        try:
            record = json.loads(os.read(fd, 4096).decode())
        except (ValueError, UnicodeDecodeError):
            return False
        if not isinstance(record, dict) or record.get("tool") != _MARKER_TOOL or record.get("host") != _host():
            return False
        pid, recorded_start = record.get("pid"), record.get("start_time")
        if not isinstance(pid, int):
            return False
        start = _start_time(pid)
        if start is not None and (recorded_start is None or abs(start - float(recorded_start)) < 0.05):
            return False  # the owner is alive
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # still held: some live process (maybe another pid namespace) owns it
            raise
        names = os.listdir(path)
        foreign = [n for n in names if n != MARKER_NAME and not is_slab_name(n)]
        if foreign:
            logger.warning(
                "tba: left the stale SSD directory %s in place: it holds files tba did not create "
                "(%s); remove it by hand",
                path,
                ", ".join(sorted(foreign)[:5]),
            )
            return False
        for name in names:
            if is_slab_name(name):
                os.unlink(os.path.join(path, name))
        os.unlink(os.path.join(path, MARKER_NAME))
        os.rmdir(path)
        return True
    finally:
        os.close(fd)
