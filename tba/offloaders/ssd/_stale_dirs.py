"""Removal of private directories left behind by dead processes (kill -9, power loss).

A directory under the parent is removed only if all of these hold: its name has our prefix; it
opens as a real directory without following a symlink and is owned by our uid; its marker (a
regular file, not a symlink) parses and names this host; its owner process is gone, or the pid
now belongs to a process started at another time; and the marker's ``flock`` can be taken.
Everything is done relative to directory handles, as in Note [Removing only what we created]:
only regular files owned by us and named like the marker or a slab are unlinked; anything else
keeps the directory in place, and the directory is removed only if its name still leads to the
directory that was inspected.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import stat

from tba.offloaders.ssd._private_dir import MARKER_NAME, MARKER_TOOL, PREFIX, host_name, is_slab_name

__all__ = ["remove_stale_dirs", "owner_alive"]

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def owner_alive(pid: int, recorded_start: object) -> bool:
    """Whether process ``pid``, recorded as started at ``recorded_start``, may still be running.

    Only a pid that is gone, or that now belongs to a process started at another time, counts
    as dead. A process whose start time cannot be read (another user's) and a marker without a
    usable start time count as alive: a wrong "dead" deletes a live run's activations.
    """
    import psutil

    try:
        start = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # includes ZombieProcess: exited, not yet reaped
        return False
    except psutil.Error:
        return True  # exists, but we may not look at it
    if not isinstance(recorded_start, int | float) or isinstance(recorded_start, bool):
        return True
    if not math.isfinite(recorded_start):
        return True
    return abs(start - float(recorded_start)) < 0.05


def remove_stale_dirs(parent: str) -> list[str]:
    """Remove directories under ``parent`` left by dead tba processes of this host.

    Returns the paths removed. Never raises for a directory it cannot inspect: it skips it.
    """
    removed: list[str] = []
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        try:
            names = [n for n in os.listdir(parent_fd) if n.startswith(PREFIX)]
        except OSError:
            return removed
        for name in names:
            path = os.path.join(parent, name)
            try:
                if _remove_if_stale(parent_fd, name, path):
                    removed.append(path)
            except OSError as e:
                logger.debug("tba: skipped %s while looking for stale SSD directories: %s", path, e)
    finally:
        os.close(parent_fd)
    if removed:
        logger.info("tba: removed %d SSD offload directories left by dead processes: %s", len(removed), removed)
    return removed


def _remove_if_stale(parent_fd: int, name: str, path: str) -> bool:
    try:
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return False  # a symlink, not a directory, or gone
    try:
        dir_stat = os.fstat(dir_fd)
        if dir_stat.st_uid != os.geteuid():
            return False
        try:
            marker_fd = os.open(MARKER_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False  # no marker we wrote: not ours
        try:
            return _remove_if_dead(parent_fd, name, path, dir_fd, dir_stat, marker_fd)
        finally:
            os.close(marker_fd)
    finally:
        os.close(dir_fd)


def _remove_if_dead(
    parent_fd: int, name: str, path: str, dir_fd: int, dir_stat: os.stat_result, marker_fd: int
) -> bool:
    marker_stat = os.fstat(marker_fd)
    if not stat.S_ISREG(marker_stat.st_mode) or marker_stat.st_uid != os.geteuid():
        return False
    try:
        record = json.loads(os.read(marker_fd, 4096).decode())
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(record, dict) or record.get("tool") != MARKER_TOOL or record.get("host") != host_name():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or owner_alive(pid, record.get("start_time")):
        return False
    try:
        fcntl.flock(marker_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False  # still held: some live process (maybe another pid namespace) owns it
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    names = os.listdir(dir_fd)
    foreign = []
    for entry in names:
        st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        ours = entry == MARKER_NAME or is_slab_name(entry)
        if not ours or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            foreign.append(entry)
    if foreign:
        logger.warning(
            "tba: left the stale SSD directory %s in place: it holds files tba did not create "
            "(%s); remove it by hand",
            path,
            ", ".join(sorted(foreign)[:5]),
        )
        return False
    for entry in names:
        os.unlink(entry, dir_fd=dir_fd)
    now = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if (now.st_dev, now.st_ino) != (dir_stat.st_dev, dir_stat.st_ino):
        return False  # replaced while we looked: not the directory we inspected
    os.rmdir(name, dir_fd=parent_fd)
    return True
