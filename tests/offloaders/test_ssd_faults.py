"""Faults: bad directories fail at construction; I/O errors surface as OffloadIOError with details.

Real kernel errors where this machine can produce them (EFBIG via RLIMIT_FSIZE, ENOSPC and EROFS
on a private tmpfs, a short read from a truncated file), injected ones otherwise (EIO, short
writes), through the engine's ``_pwrite``/``_preadv`` indirection.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from tba.errors import OffloadIOError
from tba.offloaders.ssd import SSDOffloader
from tests.offloaders.ssd_helpers import run_python, tmpfs_wrapper, typed_tensor

_MiB = 1 << 20


@pytest.fixture
def offloader(tmp_path: Path):
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=1 * _MiB, chunk_bytes=256 * 1024)
    yield off
    off.close()


# --- construction ---------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist: create it") as info:
        SSDOffloader(dirs=(str(tmp_path / "nope"),), engine="posix")
    assert str(tmp_path / "nope") in str(info.value)


def test_file_where_the_directory_should_be(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        SSDOffloader(dirs=(str(tmp_path / "file"),), engine="posix")


def test_directory_nobody_can_write_to() -> None:
    # Even root cannot create directories in /proc.
    with pytest.raises(ValueError, match=r"cannot create the SSD offload directory '/proc/tba-ssd-.*writable"):
        SSDOffloader(dirs=("/proc",), engine="posix")


def test_read_only_filesystem(tmp_path: Path) -> None:
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    code = f"""
        from tba.offloaders.ssd import SSDOffloader
        try:
            SSDOffloader(dirs=[{str(mount_point)!r}], engine="posix")
        except ValueError as e:
            print(e)
        """
    result = run_python(code, cwd=tmp_path, wrapper=tmpfs_wrapper(mount_point, "ro"))
    assert "Read-only file system" in result.stdout and "writable directory" in result.stdout


# --- injected errors ------------------------------------------------------------------------


def _fail_with(code: int):
    def call(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    return call


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_write_error_carries_path_offset_bytes_errno(offloader: SSDOffloader, code: int) -> None:
    offloader.store(torch.zeros(10, dtype=torch.uint8))  # first slab, from offset 0
    # One page, or two when the 10 bytes sit at the very end of a page in memory (Note [Direct
    # windows]): the allocator decides.
    held = offloader.used_bytes
    assert held in (4096, 8192)
    offloader._engine._pwrite = _fail_with(code)
    with pytest.raises(OffloadIOError) as info:
        offloader.store(typed_tensor(5000, torch.uint8))
    error = info.value
    # The first piece that failed: the page holding the tensor's first bytes (Note [Direct windows]).
    assert error.errno == code and error.offset == held and error.num_bytes == 4096
    assert error.path is not None and error.path.endswith("/slab-0.bin")
    assert os.strerror(code) in str(error) and "path=" in str(error) and f"offset={held}" in str(error)
    assert offloader.used_bytes == held  # the failed store gave its extent back


def test_read_error(offloader: SSDOffloader) -> None:
    token = offloader.store(typed_tensor(3 * _MiB, torch.uint8))
    offloader._engine._preadv = _fail_with(errno.EIO)
    with pytest.raises(OffloadIOError) as info:
        offloader.load(token, torch.empty(3 * _MiB, dtype=torch.uint8))
    # The first piece: the page of the ragged head, or a whole chunk if the tensor is page-aligned.
    assert info.value.errno == errno.EIO and info.value.num_bytes in (4096, 256 * 1024)
    assert "dmesg" in str(info.value)  # says what to do


def test_short_write_that_stops_is_an_error(offloader: SSDOffloader) -> None:
    offloader._engine._pwrite = lambda fd, data, offset: 0
    with pytest.raises(OffloadIOError, match="short write") as info:
        offloader.store(typed_tensor(4097, torch.uint8))
    assert info.value.errno is None and info.value.num_bytes == 4096 and info.value.path is not None
    assert offloader.used_bytes == 0


def test_partial_writes_and_reads_that_progress_are_completed(offloader: SSDOffloader) -> None:
    engine = offloader._engine
    real_pwrite, real_preadv = engine._pwrite, engine._preadv

    def half_pwrite(fd: int, data, offset: int) -> int:
        view = memoryview(data).cast("B")
        return real_pwrite(fd, view[: max(1, len(view) // 2 // 4096 * 4096) or 1], offset)

    def half_preadv(fd: int, buffers: list, offset: int) -> int:
        view = memoryview(buffers[0]).cast("B")
        return real_preadv(fd, [view[: max(1, len(view) // 2 // 4096 * 4096)]], offset)

    engine._pwrite, engine._preadv = half_pwrite, half_preadv
    src = typed_tensor(600_001, torch.uint8)
    token = offloader.store(src)
    out = torch.empty_like(src)
    offloader.load(token, out)
    assert torch.equal(src, out)


def test_short_read_from_a_truncated_file(offloader: SSDOffloader) -> None:
    token = offloader.store(typed_tensor(100_000, torch.uint8))
    os.truncate(token.extents[0].slab.path, 50_000)
    with pytest.raises(OffloadIOError, match="short read") as info:
        offloader.load(token, torch.empty(100_000, dtype=torch.uint8))
    assert info.value.path == token.extents[0].slab.path and info.value.offset is not None


def test_still_usable_after_an_error(offloader: SSDOffloader) -> None:
    engine = offloader._engine
    real = engine._pwrite
    engine._pwrite = _fail_with(errno.EIO)
    with pytest.raises(OffloadIOError):
        offloader.store(typed_tensor(2 * _MiB, torch.uint8))
    engine._pwrite = real
    src = typed_tensor(2 * _MiB, torch.uint8, seed=1)
    token = offloader.store(src)
    out = torch.empty_like(src)
    offloader.load(token, out)
    assert torch.equal(src, out)


# --- real kernel errors in child processes --------------------------------------------------

_REPORT = """
import json
def report(fn):
    try:
        fn()
    except OffloadIOError as e:
        return {"errno": e.errno, "path": e.path, "offset": e.offset, "bytes": e.num_bytes, "text": str(e)}
    return None
"""


def test_file_size_limit_gives_efbig(tmp_path: Path) -> None:
    code = f"""
        import resource, signal, torch
        from tba.errors import OffloadIOError
        from tba.offloaders.ssd import SSDOffloader
        {_REPORT.strip().replace(chr(10), chr(10) + "        ")}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
        off = SSDOffloader(dirs=[{str(tmp_path)!r}], engine="posix", slab_bytes=4 << 20)
        off.store(torch.zeros(10, dtype=torch.uint8))  # slab-0 (4 MiB) exists before the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        write = report(lambda: off.store(torch.ones(2 << 20, dtype=torch.uint8)))
        grow = report(lambda: off.store(torch.ones(8 << 20, dtype=torch.uint8)))
        off.close()
        print(json.dumps({{"write": write, "grow": grow}}))
        """
    result = json.loads(run_python(code, cwd=tmp_path).stdout.splitlines()[-1])
    write, grow = result["write"], result["grow"]
    assert write["errno"] == errno.EFBIG and write["path"].endswith("slab-0.bin")
    assert write["offset"] >= 4096 and write["bytes"] > 0 and "File too large" in write["text"]
    assert grow["errno"] == errno.EFBIG and grow["path"].endswith("slab-1.bin") and "ulimit" in grow["text"]
    assert list(tmp_path.iterdir()) == []


def test_full_drive_gives_enospc(tmp_path: Path) -> None:
    # A host tensor keeps its page offset in the file (Note [Direct windows]): a 1 MiB store
    # at page offset 64 needs 1 MiB + 4 KiB. Every tensor stored here sits at a chosen page
    # offset (0: whole pages; 64: where the CPU allocator usually puts one), so the slabs on
    # the drive, and whether the store after the releases fits in them, never depend on where
    # the allocator put a tensor (it failed once: slabs of 1 MiB from aligned tensors, then an
    # unaligned store that needed a new slab). One child runs both, one offloader after the
    # other (closing one deletes its slabs).
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    code = f"""
        import torch
        from tba.errors import OffloadIOError
        from tba.offloaders.ssd import SSDOffloader
        {_REPORT.strip().replace(chr(10), chr(10) + "        ")}
        def ones(num_bytes, page_offset):
            buffer = torch.ones(num_bytes + 8192, dtype=torch.uint8)
            start = -buffer.data_ptr() % 4096 + page_offset
            return buffer[start:start + num_bytes]
        reports = {{}}
        for page_offset in (0, 64):
            off = SSDOffloader(dirs=[{str(mount_point)!r}], engine="posix", slab_bytes=1 << 20)
            tokens = []
            full = report(lambda: [tokens.append(off.store(ones(1 << 20, page_offset))) for _ in range(8)])
            off.reserve(64 << 20)  # kept for the next store, which raises it
            reserve = report(lambda: off.store(ones(10, page_offset)))
            for t in tokens:
                off.release(t)
            again = off.store(ones(1 << 20, page_offset))  # space came back
            off.close()
            reports[page_offset] = {{"full": full, "reserve": reserve, "stored": len(tokens)}}
        print(json.dumps(reports))
        """
    result = run_python(code, cwd=tmp_path, wrapper=tmpfs_wrapper(mount_point, "size=3m"))
    for page_offset, report in json.loads(result.stdout.splitlines()[-1]).items():
        assert 1 <= report["stored"] < 8, (page_offset, report)
        for key in ("full", "reserve"):
            assert report[key]["errno"] == errno.ENOSPC, (page_offset, report)
            assert "bytes free" in report[key]["text"] and "ssd_dirs" in report[key]["text"]
