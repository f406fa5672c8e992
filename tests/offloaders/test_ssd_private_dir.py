"""The private directory removes only what this process created: a directory swapped for a
symlink, symlinks in the dead-process sweep, an owner whose start time cannot be read; and a
warning for parents others can write to without the sticky bit."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from tba.offloaders.ssd import SSDOffloader, _stale_dirs
from tba.offloaders.ssd._private_dir import MARKER_NAME, PREFIX
from tba.offloaders.ssd._stale_dirs import owner_alive, remove_stale_dirs

_DEAD_PID = 2**22 + 12345  # above the default pid_max: never a live process


def _victim(parent: Path) -> Path:
    victim = parent / "someone-elses"
    victim.mkdir()
    (victim / "slab-0.bin").write_bytes(b"their slab")
    (victim / MARKER_NAME).write_text("their marker")
    return victim


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_directory_swapped_for_a_symlink_leaves_the_target_untouched(tmp_path: Path) -> None:
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20)
    try:
        first = torch.arange(100_000, dtype=torch.int64).view(torch.uint8)
        token = off.store(first)
        directory = Path(off.directories[0])
        victim = _victim(tmp_path)
        before = _contents(victim)
        moved = tmp_path / "moved-away"
        os.rename(directory, moved)  # possible where others may write to the parent
        os.symlink(victim, directory)
        # Still works, through the directory it created: old slab read, new slab made there.
        out = torch.empty_like(first)
        off.load(token, out)
        assert torch.equal(out, first)
        off.store(torch.ones(3 << 20, dtype=torch.uint8))  # needs a second slab
        assert sorted(p.name for p in moved.iterdir()) == sorted([MARKER_NAME, "slab-0.bin", "slab-1.bin"])
        assert _contents(victim) == before
    finally:
        off.close()
    assert _contents(victim) == before
    assert directory.is_symlink()  # not ours: left in place
    assert list(moved.iterdir()) == []  # ours: emptied wherever it went


def test_sweep_never_follows_symlinks(tmp_path: Path) -> None:
    me = {"tool": "tba-ssd-offloader", "host": socket.gethostname(), "rank": 0, "pid": _DEAD_PID, "start_time": 1.0}
    # A dead process's directory, reached only through a symlink with our prefix.
    target = tmp_path / "not-a-tba-dir"
    target.mkdir()
    (target / MARKER_NAME).write_text(json.dumps(me))
    (target / "slab-0.bin").write_bytes(b"user data")
    link = tmp_path / f"{PREFIX}link"
    os.symlink(target, link)
    # A dead process's real directory whose "slab" is a symlink to a user's file.
    user_file = tmp_path / "precious.bin"
    user_file.write_bytes(b"precious")
    stale = tmp_path / f"{PREFIX}stale"
    stale.mkdir(mode=0o700)
    (stale / MARKER_NAME).write_text(json.dumps(me))
    os.symlink(user_file, stale / "slab-0.bin")
    # A dead process's marker that is a symlink.
    stale2 = tmp_path / f"{PREFIX}stale2"
    stale2.mkdir(mode=0o700)
    (tmp_path / "marker-elsewhere.json").write_text(json.dumps(me))
    os.symlink(tmp_path / "marker-elsewhere.json", stale2 / MARKER_NAME)

    assert remove_stale_dirs(str(tmp_path)) == []
    assert link.is_symlink() and _contents(target) == {MARKER_NAME: json.dumps(me).encode(), "slab-0.bin": b"user data"}
    assert (stale / "slab-0.bin").is_symlink() and user_file.read_bytes() == b"precious"
    assert (stale2 / MARKER_NAME).is_symlink()


def test_sweep_removes_a_dead_processes_directory(tmp_path: Path) -> None:
    me = {"tool": "tba-ssd-offloader", "host": socket.gethostname(), "rank": 0, "pid": _DEAD_PID, "start_time": 1.0}
    stale = tmp_path / f"{PREFIX}stale"
    stale.mkdir(mode=0o700)
    (stale / MARKER_NAME).write_text(json.dumps(me))
    (stale / "slab-0.bin").write_bytes(b"x")
    assert remove_stale_dirs(str(tmp_path)) == [str(stale)]
    assert list(tmp_path.iterdir()) == []


def test_owner_with_unreadable_start_time_counts_as_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NaN case: an owner whose start time cannot be read must count as alive, also on a
    filesystem without locks (where nothing else protects its directory)."""
    me = {"tool": "tba-ssd-offloader", "host": socket.gethostname(), "rank": 0, "pid": 4242, "start_time": 1.0}
    live = tmp_path / f"{PREFIX}live"
    live.mkdir(mode=0o700)
    (live / MARKER_NAME).write_text(json.dumps(me))
    (live / "slab-0.bin").write_bytes(b"another user's live activations")

    def unreadable(pid: int) -> psutil.Process:
        raise psutil.AccessDenied(pid)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(psutil, "Process", unreadable)
    monkeypatch.setattr(_stale_dirs.fcntl, "flock", no_locks)
    assert remove_stale_dirs(str(tmp_path)) == []
    assert (live / "slab-0.bin").exists()


def test_owner_alive() -> None:
    me = psutil.Process(os.getpid()).create_time()
    assert owner_alive(os.getpid(), me)
    assert not owner_alive(os.getpid(), me - 100)  # the pid was reused by a younger process
    assert owner_alive(os.getpid(), None) and owner_alive(os.getpid(), float("nan"))  # cannot tell
    assert not owner_alive(_DEAD_PID, 1.0) and not owner_alive(_DEAD_PID, float("nan"))


def test_shared_parent_without_sticky_bit_warns_once(tmp_path: Path) -> None:
    shared, sticky = tmp_path / "shared", tmp_path / "sticky"
    shared.mkdir()
    sticky.mkdir()
    os.chmod(shared, 0o777)
    os.chmod(sticky, 0o777 | stat.S_ISVTX)
    with pytest.warns(RuntimeWarning, match="writable by other users and its group without the sticky bit"):
        SSDOffloader(dirs=(shared,), engine="posix").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SSDOffloader(dirs=(shared,), engine="posix").close()  # once per directory
        SSDOffloader(dirs=(sticky,), engine="posix").close()
    assert list(shared.iterdir()) == [] and list(sticky.iterdir()) == []


def test_private_directory_is_0700_and_files_0600(tmp_path: Path) -> None:
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20)
    try:
        off.store(torch.ones(10, dtype=torch.uint8))
        directory = Path(off.directories[0])
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {0o600}
    finally:
        off.close()


def test_directory_replaced_by_an_empty_directory_is_not_removed(tmp_path: Path) -> None:
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20)
    off.store(torch.ones(10, dtype=torch.uint8))
    directory = Path(off.directories[0])
    moved = tmp_path / "moved-away"
    os.rename(directory, moved)
    directory.mkdir()  # someone else's, empty: an rmdir by name would take it
    off.close()
    assert directory.is_dir() and list(moved.iterdir()) == []


def test_a_file_replaced_under_a_slab_name_is_left_in_place(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only the very file tba created is deleted: another file put under a slab's name (same
    name, another inode) survives close(), and tba says it left it."""
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20)
    try:
        off.release(off.store(torch.ones(4096, dtype=torch.uint8)))
        directory = Path(off.directories[0])
        slab = directory / "slab-0.bin"
        assert slab.exists()
        slab.rename(directory / "moved.bin")  # ours, under another name now
        slab.write_bytes(b"someone else's file")
    finally:
        with caplog.at_level("WARNING", logger="tba"):
            off.close()
    assert slab.read_bytes() == b"someone else's file"
    assert "it is not the file tba created" in caplog.text
