"""Disk space of the SSD offloader: bounded over steps, preallocation, removal of dead processes' dirs."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
from pathlib import Path

import pytest
import torch

from tba.errors import OffloadIOError
from tba.offloaders.ssd import SSDOffloader
from tba.offloaders.ssd._private_dir import MARKER_NAME, PREFIX
from tests.offloaders.ssd_helpers import kill_group, start_python, typed_tensor

_MiB = 1 << 20
# One simulated training step: the sizes of the activations forward saves.
_STEP_SIZES = [1 * _MiB + 1, 300_000, 2 * _MiB, 4097, 511, 700_000, 1_500_000, 65_536, 3, 2 * _MiB - 5]


def _disk_bytes(directory: str) -> int:
    """Bytes the filesystem allocated to the files under ``directory``."""
    total = 0
    for entry in os.scandir(directory):
        total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


@pytest.mark.parametrize(
    ("num_dirs", "slab_bytes"), [(1, None), (1, 1 * _MiB), (2, 1 * _MiB)], ids=["default", "1dir", "2dirs"]
)
def test_thirty_steps_stay_bounded_and_close_removes_everything(
    tmp_path: Path, num_dirs: int, slab_bytes: int | None
) -> None:
    parents = [tmp_path / f"drive{i}" for i in range(num_dirs)]
    for p in parents:
        p.mkdir()
    sizes = {} if slab_bytes is None else {"slab_bytes": slab_bytes}
    off = SSDOffloader(dirs=[str(p) for p in parents], engine="posix", **sizes)
    step_bytes = sum(_STEP_SIZES)
    tensors = [typed_tensor(n, torch.uint8, seed=i) for i, n in enumerate(_STEP_SIZES)]
    capacities = []
    for step in range(30):
        tokens = [off.store(t) for t in tensors]  # forward
        for t, token in zip(reversed(tensors), reversed(tokens)):  # backward, reverse order
            if step % 10 == 0:
                out = torch.empty_like(t)
                off.load(token, out)
                assert torch.equal(t, out)
            off.release(token)
        assert off.used_bytes == 0
        capacities.append(off.capacity_bytes)
        disk = sum(_disk_bytes(d) for d in off.directories)
        # 1.5x, plus what host tensors' page offsets cost (Note [Direct windows]): up to a page
        # per extent, which can tip a tensor larger than slab_bytes into one more MiB of its slab.
        assert disk <= 1.65 * step_bytes, f"step {step}: {disk} bytes on disk for a {step_bytes}-byte step"
    assert capacities[1:] == capacities[:-1], "slabs kept growing although every step is the same"
    directories = off.directories
    off.close()
    off.close()  # idempotent
    assert not any(os.path.exists(d) for d in directories)
    assert all(list(p.iterdir()) == [] for p in parents)
    with pytest.raises(OffloadIOError, match="closed"):
        off.store(tensors[0])


def test_reserve_preallocates_and_reports_shortage_with_numbers(tmp_path: Path) -> None:
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=1 * _MiB)
    try:
        off.reserve(5 * _MiB + 1)
        assert off.capacity_bytes >= 5 * _MiB + 1
        assert _disk_bytes(off.directories[0]) >= 5 * _MiB  # really allocated, not sparse
        before = off.capacity_bytes
        off.reserve(3 * _MiB)  # already there: nothing added
        assert off.capacity_bytes == before
        off.reserve(1 << 60)  # raises nothing itself (the cache calls it in a destructor) ...
        with pytest.raises(OffloadIOError) as info:
            off.store(torch.ones(10, dtype=torch.uint8))  # ... the next store raises it
        assert info.value.errno == errno.ENOSPC
        assert "bytes free" in str(info.value) and str(1 << 60) in str(info.value)
        assert "ssd_dirs" in str(info.value)  # says what to do
        off.store(torch.ones(10, dtype=torch.uint8))  # raised once: the next store works
    finally:
        off.close()


def test_expected_bytes_too_large_fails_at_construction_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(OffloadIOError, match="not enough free disk space"):
        SSDOffloader(dirs=(str(tmp_path),), engine="posix", expected_bytes=1 << 60)
    assert list(tmp_path.iterdir()) == []


def test_killed_process_directory_is_removed_by_the_next_offloader(tmp_path: Path) -> None:
    child = start_python(
        f"""
        import time, torch
        from tba.offloaders.ssd import SSDOffloader
        off = SSDOffloader(dirs=[{str(tmp_path)!r}], engine="posix", slab_bytes=1 << 20)
        tokens = [off.store(torch.full((300_000,), i, dtype=torch.uint8)) for i in range(3)]
        print(off.directories[0], flush=True)
        while True:  # mid-way through "training"
            off.release(tokens.pop(0)); tokens.append(off.store(torch.zeros(300_000, dtype=torch.uint8)))
            time.sleep(0.01)
        """,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        left = child.stdout.readline().strip()
        assert left, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        kill_group(child)
    assert os.path.isdir(left) and any(name.startswith("slab-") for name in os.listdir(left))
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    try:
        assert not os.path.exists(left)
        assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(off.directories[0])]
    finally:
        off.close()


def _fake_dir(parent: Path, name: str, marker: dict | None, extra: str | None = None) -> Path:
    path = parent / f"{PREFIX}{name}"
    path.mkdir(mode=0o700)
    if marker is not None:
        (path / MARKER_NAME).write_text(json.dumps(marker))
    (path / "slab-0.bin").write_bytes(b"x")
    if extra:
        (path / extra).write_text("not tba's")
    return path


def test_only_dead_processes_own_directories_are_removed(tmp_path: Path) -> None:
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    me = {"tool": "tba-ssd-offloader", "host": socket.gethostname(), "rank": 0}
    dead = _fake_dir(tmp_path, "dead", {**me, "pid": dead_pid, "start_time": 1.0})
    alive = _fake_dir(tmp_path, "alive", {**me, "pid": os.getpid(), "start_time": None})
    other_host = _fake_dir(tmp_path, "elsewhere", {**me, "host": "another-host", "pid": dead_pid, "start_time": 1.0})
    no_marker = _fake_dir(tmp_path, "nomarker", None)
    garbage_marker = _fake_dir(tmp_path, "garbage", None)
    (garbage_marker / MARKER_NAME).write_text("{not json")
    foreign_file = _fake_dir(tmp_path, "foreign", {**me, "pid": dead_pid, "start_time": 1.0}, extra="notes.txt")
    unrelated = tmp_path / "my-data"
    unrelated.mkdir()
    (unrelated / "slab-0.bin").write_bytes(b"user data")

    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    off.close()

    assert not dead.exists()
    for kept in (alive, other_host, no_marker, garbage_marker, foreign_file, unrelated):
        assert kept.exists(), kept
    assert (foreign_file / "notes.txt").exists() and (foreign_file / "slab-0.bin").exists()
    assert (unrelated / "slab-0.bin").read_bytes() == b"user data"


def test_live_offloader_of_this_process_is_never_removed(tmp_path: Path) -> None:
    first = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    try:
        token = first.store(torch.arange(100, dtype=torch.uint8))
        second = SSDOffloader(dirs=(str(tmp_path),), engine="posix", rank=1)
        second.close()
        out = torch.empty(100, dtype=torch.uint8)
        first.load(token, out)
        assert torch.equal(out, torch.arange(100, dtype=torch.uint8))
        name = os.path.basename(first.directories[0])
        assert name.startswith(f"{PREFIX}") and f"-{os.getpid()}-rx-" in name
    finally:
        first.close()
