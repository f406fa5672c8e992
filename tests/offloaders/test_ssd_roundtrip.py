"""Bit-exact store/load round trips through the SSD offloader's posix engine, striping, chunking."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tba.offloaders.base import Offloader
from tba.offloaders.ssd import SSDOffloader
from tests.offloaders.ssd_helpers import DTYPES, EDGE_SIZES, as_bytes, typed_tensor

_MiB = 1 << 20


@pytest.fixture
def offloader(tmp_path: Path):
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=2 * _MiB, chunk_bytes=1 * _MiB)
    yield off
    off.close()


def test_is_an_offloader(offloader: SSDOffloader) -> None:
    assert isinstance(offloader, Offloader)
    assert offloader.name == "ssd" and offloader.engine == "posix"


@pytest.mark.parametrize("num_bytes", EDGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact(offloader: SSDOffloader, device: str, dtype: torch.dtype, num_bytes: int) -> None:
    original = typed_tensor(num_bytes, dtype, device)
    token = offloader.store(as_bytes(original))
    restored = torch.empty_like(original)
    offloader.load(token, as_bytes(restored))
    assert torch.equal(as_bytes(original), as_bytes(restored))
    # Load twice: a stored tensor stays readable until released.
    again = torch.empty_like(original)
    offloader.load(token, as_bytes(again))
    assert torch.equal(as_bytes(original), as_bytes(again))
    offloader.release(token)
    assert offloader.used_bytes == 0


def test_odd_shapes_and_unaligned_source(offloader: SSDOffloader) -> None:
    base = typed_tensor(3 * _MiB + 7, torch.uint8)
    for start in (1, 7, 4095):  # a source that is a slice: no O_DIRECT-aligned address
        src = base[start:]
        token = offloader.store(src)
        out = torch.zeros(src.numel() + 1, dtype=torch.uint8)[1:]  # unaligned destination too
        offloader.load(token, out)
        assert torch.equal(src, out)
        offloader.release(token)
    odd = typed_tensor(3 * 5 * 7 * 4, torch.float32).view(3, 5, 7)
    token = offloader.store(as_bytes(odd))
    out = torch.empty_like(odd)
    offloader.load(token, as_bytes(out))
    assert torch.equal(as_bytes(odd), as_bytes(out))


@pytest.mark.parametrize("verify", ["none", "checksum"])
def test_page_aligned_source_goes_straight_to_disk(tmp_path: Path, verify: str) -> None:
    """A page-aligned CPU source is written with O_DIRECT straight from its memory, with or
    without verification (Note [Checksums of what was written]: summed before and after)."""
    offloader = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=2 * _MiB,
                             chunk_bytes=1 * _MiB, verify=verify)
    num_bytes = 2 * _MiB + 4097
    second = -(-num_bytes // 4096) * 4096
    memory = mmap.mmap(-1, 2 * second)
    src = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=num_bytes))
    dst = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=num_bytes, offset=second))
    assert src.data_ptr() % 4096 == 0 and dst.data_ptr() % 4096 == 0
    src.copy_(typed_tensor(num_bytes, torch.uint8, seed=3))
    try:
        token = offloader.store(src)
        offloader.load(token, dst)
        assert torch.equal(src, dst)
        # Only the ragged tail (1 byte) went through a staging buffer.
        assert offloader._engine._pool._num_allocated == 1
    finally:
        offloader.close()
    del src, dst


def test_zero_bytes(offloader: SSDOffloader) -> None:
    token = offloader.store(torch.empty(0, dtype=torch.uint8))
    offloader.load(token, torch.empty(0, dtype=torch.uint8))
    offloader.release(token)


def test_striping_spreads_large_tensors_and_rotates_small_ones(tmp_path: Path) -> None:
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    off = SSDOffloader(dirs=[str(d) for d in dirs], engine="posix", slab_bytes=1 * _MiB, stripe_min_bytes=1 * _MiB)
    try:
        big = typed_tensor(3 * _MiB + 1, torch.uint8)
        token = off.store(big)
        assert {e.slab.path.split("/tba-ssd-")[0] for e in token.extents} == {str(d) for d in dirs}
        out = torch.empty_like(big)
        off.load(token, out)
        assert torch.equal(big, out)
        small = [off.store(typed_tensor(5000, torch.uint8, seed=i)) for i in range(3)]
        assert len({t.extents[0].slab_dir.path for t in small}) == 3
        two = off.store(typed_tensor(2 * _MiB, torch.uint8))
        assert len(two.extents) == 2  # 2 MiB // 1 MiB stripes over two directories
    finally:
        off.close()
    assert all(list(d.iterdir()) == [] for d in dirs)


def test_many_threads_with_few_staging_buffers_do_not_deadlock(tmp_path: Path) -> None:
    off = SSDOffloader(
        dirs=(str(tmp_path),), engine="posix", slab_bytes=1 * _MiB, chunk_bytes=16384,
        num_io_threads=2, num_staging_buffers=2,
    )
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(5):
                src = typed_tensor(100_000 + 4097 * i + seed, torch.uint8, seed=seed * 10 + i)[1:]
                token = off.store(src)
                out = torch.empty_like(src)
                off.load(token, out)
                assert torch.equal(src, out)
                off.release(token)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not any(t.is_alive() for t in threads), "store/load deadlocked"
        assert not errors, errors
        assert off.used_bytes == 0
    finally:
        off.close()


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EFAULT], ids=["EINVAL", "EFAULT"])
def test_o_direct_refused_falls_back_to_buffered_with_one_notice(
    offloader: SSDOffloader, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """EINVAL (alignment, filesystem) and EFAULT (drivers refusing O_DIRECT into pinned
    memory) both fall back to buffered I/O for the file, with one notice."""
    engine = offloader._engine
    real_pwrite = engine._pwrite

    def no_direct(fd: int, data: object, offset: int) -> int:
        if any(fd == e.slab.handle.direct_fd for e in getattr(no_direct, "extents", ())):
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, offset)

    token = offloader.store(typed_tensor(10, torch.uint8))  # opens the slab
    no_direct.extents = token.extents  # type: ignore[attr-defined]
    engine._pwrite = no_direct
    src = typed_tensor(3 * 4096, torch.uint8, seed=5)
    with caplog.at_level(logging.WARNING, logger="tba"):
        second = offloader.store(src)
        third = offloader.store(src)
    assert token.extents[0].slab.handle.direct_fd is None
    out = torch.empty_like(src)
    offloader.load(second, out)
    assert torch.equal(src, out)
    offloader.load(third, out)
    assert torch.equal(src, out)
    assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1


def test_bad_arguments_are_value_errors(offloader: SSDOffloader) -> None:
    with pytest.raises(ValueError, match="1-D contiguous torch.uint8"):
        offloader.store(torch.zeros(4, dtype=torch.float32))
    token = offloader.store(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds 8"):
        offloader.load(token, torch.zeros(9, dtype=torch.uint8))
    offloader.release(token)
    offloader.release(token)  # idempotent
    with pytest.raises(ValueError, match="released"):
        offloader.load(token, torch.zeros(8, dtype=torch.uint8))


def test_invalid_settings_are_listed_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        SSDOffloader(dirs=(str(tmp_path / "missing"),), engine="fast", slab_bytes=1000, rank=-1)  # type: ignore[arg-type]
    message = str(info.value)
    for part in ("ssd_engine", "slab_bytes", "rank", "does not exist"):
        assert part in message


def test_auto_engine_is_posix_without_cuda(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only choice")
    with caplog.at_level(logging.DEBUG, logger="tba"):
        off = SSDOffloader(dirs=(str(tmp_path),))
    off.close()
    assert off.engine == "posix"
    assert any("no CUDA device" in r.getMessage() for r in caplog.records)


def test_default_directory_comes_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setenv("TBA_SSD_DIR", f"{a}:{b}")
    off = SSDOffloader(engine="posix")
    try:
        assert [str(Path(d).parent) for d in off.directories] == [str(a), str(b)]
        assert all(Path(d).stat().st_mode & 0o777 == 0o700 for d in off.directories)
    finally:
        off.close()


def test_filesystem_refusing_o_direct_at_open_uses_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def no_o_direct(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_o_direct)
    with caplog.at_level(logging.WARNING, logger="tba"):
        off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=1 * _MiB, chunk_bytes=1 * _MiB,
                           verify="none")
        try:
            src = typed_tensor(2 * _MiB + 3, torch.uint8)[3:]
            token = off.store(src)
            assert token.extents[0].slab.handle.direct_fd is None
            out = torch.empty_like(src)
            off.load(token, out)
            assert torch.equal(src, out)
            assert off._engine._pool._num_allocated == 0  # buffered I/O needs no staging on CPU
        finally:
            off.close()
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("misalignment", [0, 512, 4095])
def test_pieces_start_on_aligned_memory_addresses(tmp_path: Path, misalignment: int) -> None:
    """Issue 16, finding 8: striped pieces of a buffer start on 4 KiB-aligned memory addresses
    (GPUDirect Storage bounces unaligned device addresses), and still cover it exactly."""
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    off = SSDOffloader(dirs=tuple(map(str, dirs)), engine="posix", slab_bytes=4 * _MiB,
                       stripe_min_bytes=1 * _MiB)
    try:
        address = 1 << 30 | misalignment
        pieces = off._pieces(3 * _MiB + 100, address)
        assert len(pieces) == 3
        assert pieces[0][0] == 0 and pieces[-1][1] == 3 * _MiB + 100
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all((address + start) % 4096 == 0 for start, _, _ in pieces[1:])
        memory = torch.zeros(3 * _MiB + 100 + misalignment, dtype=torch.uint8)
        src = typed_tensor(3 * _MiB + 100, torch.uint8, seed=7)
        view = memory[misalignment:]
        view.copy_(src)
        token = off.store(view)
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src)
    finally:
        off.close()


def test_storing_leaves_the_source_resizable(offloader: SSDOffloader) -> None:
    """``Tensor.numpy()`` would mark a saved storage as not resizable for good; frameworks free
    saved storages with ``resize_(0)`` (FSDP, Megatron), which must keep working."""
    src = typed_tensor(3 * _MiB + 5, torch.uint8, seed=11)
    token = offloader.store(src)
    assert src.untyped_storage().resizable()
    out = torch.empty_like(src)
    offloader.load(token, out)
    assert torch.equal(out, src) and out.untyped_storage().resizable()
    src.untyped_storage().resize_(0)
    offloader.release(token)


def test_reserve_zero_frees_idle_staging_buffers(offloader: SSDOffloader) -> None:
    # Note [A keep-everything decision holds no offloader memory] in tba/cache/steps/steps.py: the
    # staging buffers of the posix engine go; the next unaligned store makes one again.
    src = typed_tensor(3 * _MiB + 5, torch.uint8)[5:]  # not page-aligned: staged
    token = offloader.store(src)
    pool = offloader._engine._pool
    assert pool._num_allocated >= 1
    offloader.reserve(0)
    assert pool._num_allocated == 0 and not pool._free
    out = torch.empty_like(src)
    offloader.load(token, out)
    assert torch.equal(out, src) and pool._num_allocated >= 1
    offloader.release(token)


def test_staging_trim_keeps_buffers_in_use() -> None:
    from tba.offloaders.ssd._staging import StagingPool

    pool = StagingPool(4096, max_buffers=3)
    held, idle = pool.acquire(block=True), pool.acquire(block=True)
    pool.release(idle)
    pool.trim()
    assert pool._num_allocated == 1 and not pool._free
    pool.release(held)  # the one in use comes back and counts within the limit
    assert [pool.acquire(block=False) for _ in range(3)].count(None) == 0
    assert pool.acquire(block=False) is None
