"""Note [Direct windows]: the page-aligned interior of a host tensor moves with O_DIRECT straight
between its memory and the file (no staging copy), only the ragged head and tail are staged, and
the checksums stay as strong: every byte written is checksummed and verified on load, a source
written during its store is not reported as corruption, and corruption of directly written
bytes is caught."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tba.cache.engine.streams import host_buffer
from tba.errors import OffloadIOError
from tba.offloaders.ssd import SSDOffloader
from tba.offloaders.ssd._windows import plan_pieces
from tests.offloaders.ssd_helpers import typed_tensor

_PAGE = 4096
_MiB = 1 << 20


class _Memory:
    """Page-aligned host memory to cut sources at exact page offsets from."""

    def __init__(self, num_bytes: int) -> None:
        self._map = mmap.mmap(-1, num_bytes)
        self.tensor = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8))
        assert self.tensor.data_ptr() % _PAGE == 0


def _require_o_direct(directory: Path) -> None:
    probe = directory / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip(f"the filesystem of {directory} refuses O_DIRECT")
    finally:
        probe.unlink(missing_ok=True)


def _recording(engine) -> list[tuple[str, int, int, int]]:
    """Wrap the engine's pwrite/preadv: (op, descriptor, address, bytes) of every call."""
    calls: list[tuple[str, int, int, int]] = []
    real_pwrite, real_preadv = engine._pwrite, engine._preadv

    def note(op: str, fd: int, view: np.ndarray) -> None:
        calls.append((op, fd, view.ctypes.data, len(view)))

    def pwrite(fd: int, data: np.ndarray, offset: int) -> int:
        note("write", fd, data)
        return real_pwrite(fd, data, offset)

    def preadv(fd: int, buffers: list, offset: int) -> int:
        note("read", fd, buffers[0])
        return real_preadv(fd, buffers, offset)

    engine._pwrite, engine._preadv = pwrite, preadv
    return calls


def _in(address: int, tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() <= address < tensor.data_ptr() + tensor.numel()


# head: bytes before the first page boundary of the source; tail: bytes after the last one.
_CASES = {
    "none": (0, 3 * _PAGE),
    "head": (64, 3 * _PAGE - 64),
    "tail": (0, 3 * _PAGE + 100),
    "both": (4032, 5 * _PAGE + 7),
    "odd-both": (1, 2 * _PAGE),
    "last-byte-head": (4095, 2 * _PAGE + 1),
    "under-a-page": (100, 1000),
    "under-a-page-crossing": (4000, 1000),
    "exactly-a-page": (0, _PAGE),
    "a-page-unaligned": (512, _PAGE),
    "several-chunks": (64, 3 * _MiB + 5),
}


@pytest.mark.parametrize("verify", ["checksum", "none"])
@pytest.mark.parametrize("case", list(_CASES))
def test_every_alignment_round_trips_bit_exact_and_the_interior_goes_straight(
    tmp_path: Path, case: str, verify: str
) -> None:
    phase, num_bytes = _CASES[case]
    _require_o_direct(tmp_path)
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=8 * _MiB, chunk_bytes=1 * _MiB,
                       verify=verify)
    memory = _Memory(num_bytes + 2 * _PAGE)
    try:
        src = memory.tensor[phase : phase + num_bytes]
        src.copy_(typed_tensor(num_bytes, torch.uint8, seed=num_bytes + phase))
        expected = src.clone()
        calls = _recording(off._engine)
        token = off.store(src)
        handle = token.extents[0].slab.handle
        assert handle.direct_fd is not None, "an O_DIRECT transfer failed and the file fell back"
        assert token.extents[0].data_offset % _PAGE == phase  # Note [Direct windows]
        dst = host_buffer(num_bytes, phase)
        off.load(token, dst)
        assert torch.equal(dst, expected)
        # And into a destination at another page offset: everything staged, still exact.
        other = torch.empty(num_bytes + _PAGE, dtype=torch.uint8)
        shift = (phase + 8 - other.data_ptr()) % _PAGE
        other = other[shift : shift + num_bytes]
        off.load(token, other)
        assert torch.equal(other, expected)
        # Every whole page of the source (there are some exactly when the range covers one)
        # moved straight between the tensor's memory and the O_DIRECT descriptor.
        whole_pages = (phase + num_bytes) // _PAGE * _PAGE - -(-phase // _PAGE) * _PAGE
        for op, target in (("write", src), ("read", dst)):
            straight = sum(
                n for o, fd, address, n in calls if o == op and fd == handle.direct_fd and _in(address, target)
            )
            assert straight == max(0, whole_pages), (op, straight, whole_pages)
        off.release(token)
    finally:
        off.close()


@pytest.mark.parametrize("address_phase", [0, 64, 4095])
@pytest.mark.parametrize("file_phase", [0, 64, 4095])
@pytest.mark.parametrize("num_bytes", [1, 4095, 4096, 4097, 3 * _PAGE + 9, 5 * _MiB + 3])
def test_plan_covers_every_byte_once_in_whole_page_windows(address_phase: int, file_phase: int, num_bytes: int) -> None:
    chunk = 1 * _MiB
    pieces = plan_pieces(1 << 30 | address_phase, 8 * _PAGE + file_phase, num_bytes, chunk, host=True, o_direct=True)
    assert [p.start for p in pieces] == [0] + [p.stop for p in pieces[:-1]] and pieces[-1].stop == num_bytes
    windows = []
    for p in pieces:
        n = p.stop - p.start
        assert 0 < p.window_bytes <= chunk and p.window_bytes % _PAGE == 0 and p.window_offset % _PAGE == 0
        assert p.window_offset + p.lead == 8 * _PAGE + file_phase + p.start and p.lead + n <= p.window_bytes
        if p.direct:
            assert address_phase == file_phase and (address_phase + p.start) % _PAGE == 0 and n % _PAGE == 0
        windows.append((p.window_offset, p.window_offset + p.window_bytes))
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:])), "two pieces share a page"
    staged = sum(p.stop - p.start for p in pieces if not p.direct)
    if address_phase == file_phase:
        assert staged < 2 * _PAGE, "only the ragged head and tail are staged"


def test_corruption_of_directly_written_bytes_is_caught(tmp_path: Path) -> None:
    """Bytes that went straight from the tensor to the file are checksummed like staged ones."""
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=4 * _MiB, chunk_bytes=1 * _MiB)
    memory = _Memory(3 * _MiB)
    try:
        src = memory.tensor[64 : 64 + 2 * _MiB]
        src.copy_(typed_tensor(src.numel(), torch.uint8, seed=9))
        token = off.store(src)
        extent = token.extents[0]
        for position in (_PAGE - 64, _MiB, 2 * _MiB - _PAGE - 65):  # first, middle, last direct page
            with open(extent.slab.path, "r+b", buffering=0) as f:
                f.seek(extent.data_offset + position)
                byte = f.read(1)[0]
                f.seek(extent.data_offset + position)
                f.write(bytes([byte ^ 0x40]))
            with pytest.raises(OffloadIOError, match="changed since it was written") as info:
                off.load(token, host_buffer(src.numel(), 64))
            assert info.value.path == extent.slab.path and info.value.offset == extent.data_offset
            with open(extent.slab.path, "r+b", buffering=0) as f:  # undo
                f.seek(extent.data_offset + position)
                f.write(bytes([byte]))
        out = host_buffer(src.numel(), 64)
        off.load(token, out)
        assert torch.equal(out, src)
    finally:
        off.close()


@pytest.mark.parametrize("region", ["staged-tail", "direct-interior"])
def test_a_source_written_elsewhere_during_its_store_is_not_corruption(tmp_path: Path, region: str) -> None:
    """Note [Checksums of what was written]: another version-counter family may write its own
    region of a storage while the storage is being stored (PyTorch's CPU GRU/LSTM kernels do).
    The checksum must describe the bytes that reached the file, so the reload verifies: a staged
    piece is summed from its staging copy; a direct piece is summed before and after its write,
    and the tensor written again from a snapshot when it moved."""
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=4 * _MiB, chunk_bytes=1 * _MiB)
    memory = _Memory(4 * _MiB)
    try:
        engine = off._engine
        src = memory.tensor[64 : 64 + 3 * _MiB + 100]  # head, 3 MiB - 4 KiB interior, tail
        src.zero_()
        sibling = src[-50:] if region == "staged-tail" else src[_MiB : _MiB + _PAGE]
        real_pwrite = engine._pwrite
        writes = []

        def pwrite_while_another_family_writes(fd: int, data: object, offset: int) -> int:
            written = real_pwrite(fd, data, offset)
            writes.append(offset)
            sibling.add_(1)  # the sibling's region, written in place during the store
            return written

        engine._pwrite = pwrite_while_another_family_writes
        token = off.store(src)
        engine._pwrite = real_pwrite
        num_pieces = 2 + 3  # head and tail pages, three 1 MiB chunks of the interior
        if region == "staged-tail":
            assert len(writes) == num_pieces, "a staged piece's checksum is exact: nothing to write again"
        else:
            assert len(writes) > num_pieces, "the moved source was not written again from a snapshot"
        out = host_buffer(src.numel(), 64)
        off.load(token, out)  # no "data on disk changed" error
        keep = torch.ones_like(src, dtype=torch.bool)
        keep[sibling.data_ptr() - src.data_ptr() :][: sibling.numel()] = False
        assert torch.equal(out[keep], src[keep])  # the saved family's bytes are exact
    finally:
        off.close()


def _big_batch(seed: int) -> torch.Tensor:
    """128 rows: activations of 64-256 KiB, several pages each."""
    from tests import models

    return torch.cat([models.vector_batch(seed * 16 + i) for i in range(16)])


def test_training_with_direct_windows_is_bit_exact(tmp_path: Path) -> None:
    """3 Adam steps with every store completed before backward: stores and reloads of the CPU
    activations move their page-aligned interiors straight between tensor memory and the file
    (Note [Reload buffers at the source's page offset]), and training stays bit-exact, verified."""
    from tests import models
    from tests.twin import assert_bytes_moved, run_twins

    staging: list[tuple[int, int]] = []  # every staging buffer the engine made

    def record(cache) -> None:
        engine = cache.offloader._engine
        calls.append(_recording(engine))
        pool = engine._pool
        allocate = pool._allocate

        def remember():
            buffer = allocate()
            staging.append((buffer.tensor.data_ptr(), buffer.tensor.numel()))
            return buffer

        pool._allocate = remember

    calls: list = []

    cache = run_twins(
        lambda: models.Stack(num_blocks=4, width=128), _big_batch, steps=3, settle=True,
        on_configure=record, offloader="ssd", ssd_engine="posix", ssd_dirs=(str(tmp_path),),
        offload_devices=("cpu",), min_offload_bytes=0, adaptive=False, keep_last_modules=0,
        prefetch_modules=0, verify="checksum",
    )
    total = assert_bytes_moved(cache)
    assert total.num_io_errors == 0 and total.io_cpu_s > 0
    recorded = calls[0]
    assert staging, "the ragged heads and tails went through staging buffers"

    def straight(op: str) -> int:
        return sum(
            n for o, _fd, address, n in recorded
            if o == op and not any(a <= address < a + size for a, size in staging)
        )

    assert straight("write") > 0.5 * total.offloaded_bytes, "stores were copied through staging"
    assert straight("read") > 0.5 * total.reloaded_bytes, "reloads were copied through staging"
