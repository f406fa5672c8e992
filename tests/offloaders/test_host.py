"""The host pool offloader and its extent allocator: exact round trips, reuse, sizing."""

from __future__ import annotations

import pytest
import torch

from tba.offloaders import HostOffloader
from tba.offloaders.extents import ExtentAllocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
SIZES = [1, 511, 4097, 3 * 2**20 + 1]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@pytest.mark.parametrize("num_bytes", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(device: str, dtype: torch.dtype, num_bytes: int) -> None:
    g = torch.Generator().manual_seed(num_bytes)
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)
    whole = raw[: num_bytes - num_bytes % dtype.itemsize] if num_bytes >= dtype.itemsize else raw
    typed = whole.view(dtype) if whole.numel() >= dtype.itemsize else whole
    if dtype is torch.bool:
        typed = whole.bool()  # only 0/1 bytes are valid bools
    typed = typed.to(device)
    if typed.dim() == 1 and typed.numel() >= 4:
        typed = typed[1:].unfold(0, 2, 2)  # a non-contiguous view into the storage
    src = _as_bytes(typed)
    off = HostOffloader()
    token = off.store(src)
    dst = torch.empty_like(src)
    off.load(token, dst)
    restored = torch.empty(0, dtype=typed.dtype, device=device).set_(
        dst.untyped_storage(), typed.storage_offset(), typed.size(), typed.stride())
    assert torch.equal(dst, src)  # every byte, NaN payloads included
    torch.testing.assert_close(restored, typed, rtol=0, atol=0, equal_nan=True)
    off.release(token)
    off.close()


def test_pool_reuses_space_and_is_sized_by_reserve() -> None:
    off = HostOffloader()
    tensors = [torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate((1000, 70 << 20, 5))]
    for _ in range(5):
        tokens = [off.store(t) for t in tensors]
        for t, token in zip(tensors, tokens):
            out = torch.empty_like(t)
            off.load(token, out)
            assert torch.equal(out, t)
            off.release(token)
    grown = off.capacity_bytes
    assert off.used_bytes == 0 and grown >= (70 << 20)
    assert grown < 3 * (71 << 20)  # reused, not grown every step
    off.reserve(100 << 20)  # recorded only: applied at the next store into an empty pool
    assert off.capacity_bytes == grown
    token = off.store(tensors[1])
    assert off.capacity_bytes == 100 << 20  # old slabs given back, one slab of the reserved size
    off.reserve(10 << 20)  # one slab big enough: nothing to do
    off.release(token)
    token = off.store(tensors[1])
    assert off.capacity_bytes == 100 << 20
    off.release(token)
    off.close()


def test_extent_allocator_first_fit_and_coalescing() -> None:
    a = ExtentAllocator(16 * 4096, alignment=4096)
    x = a.allocate(1)
    y = a.allocate(4097)
    z = a.allocate(4096)
    assert (x, y, z) == (0, 4096, 3 * 4096)
    assert a.allocate(13 * 4096) is None and a.allocate(12 * 4096) == 4 * 4096
    a.free(y)
    assert a.allocate(2 * 4096) == 4096  # the hole is reused
    a.free(4096)
    a.free(x)
    a.free(z)
    a.free(4 * 4096)
    assert a.used_bytes == 0 and a.largest_free_bytes == 16 * 4096  # fully coalesced
    with pytest.raises(AssertionError):
        a.free(4096)
    with pytest.raises(ValueError):
        ExtentAllocator(4096, alignment=3)


def test_storing_leaves_the_source_resizable() -> None:
    """``Tensor.numpy()`` would mark a saved storage as not resizable for good; frameworks free
    saved storages with ``resize_(0)`` (FSDP, Megatron), which must keep working."""
    from tba.offloaders.host import HostOffloader

    off = HostOffloader()
    try:
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8).clone()
        token = off.store(src)
        assert src.untyped_storage().resizable()
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src) and out.untyped_storage().resizable()
        src.untyped_storage().resize_(0)
        off.release(token)
    finally:
        off.close()


def test_max_pool_bytes_caps_the_pool() -> None:
    import tba

    off = HostOffloader(max_pool_bytes=3000)  # rounded up to 3072: six 512-byte extents
    tokens = [off.store(torch.full((1000,), i, dtype=torch.uint8)) for i in range(3)]  # 1024 each
    assert off.capacity_bytes == 3072 and off.try_store(torch.zeros(1, dtype=torch.uint8)) is None
    with pytest.raises(tba.TBAError, match="max_pool_bytes=3072"):
        off.store(torch.zeros(1, dtype=torch.uint8))
    off.release(tokens[1])
    token = off.try_store(torch.full((1024,), 7, dtype=torch.uint8))  # the freed extent, exactly
    assert token is not None and token[1] == 1024
    for t in (tokens[0], token, tokens[2]):
        off.release(t)
    off.reserve(1 << 20)  # a reservation past the cap is cut to it
    token = off.store(torch.zeros(10, dtype=torch.uint8))
    assert off.capacity_bytes == 3072
    off.release(token)
    off.close()
    with pytest.raises(ValueError, match="max_pool_bytes must be None or > 0"):
        HostOffloader(max_pool_bytes=0)


@pytest.mark.parametrize("outer_bytes, fits", [(1024, True), (4096, False)])
def test_max_pool_bytes_holds_when_another_store_grows_the_pool_meanwhile(outer_bytes: int, fits: bool) -> None:
    from tba.offloaders.host_memory import HostAllocator, HostBuffer

    class Racing(HostAllocator):
        """The first slab allocation lets another store run first (as a second store thread would
        while this one allocates without the pool's lock) and grow the pool to its cap."""

        raced = False

        def allocate(self, num_bytes: int, *, pinned: bool) -> HostBuffer:
            if not self.raced:
                self.raced = True
                assert off.try_store(torch.ones(1024, dtype=torch.uint8)) is not None
            return super().allocate(num_bytes, pinned=pinned)

    off = HostOffloader(max_pool_bytes=4096, allocator=Racing())
    src = torch.full((outer_bytes,), 3, dtype=torch.uint8)
    token = off.try_store(src)
    assert off.capacity_bytes == 4096  # the slab the racing store made; the second was given back
    assert (token is not None) == fits
    if token is not None:
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src) and token[1] == 1024
    off.close()


def _resident_pages(buffer_tensor: torch.Tensor, start: int, stop: int) -> list[bool]:
    """Which pages of ``buffer_tensor`` (page-aligned) in bytes ``[start, stop)`` are in memory
    (``mincore``)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    num_pages = (stop - start) // page
    vec = (ctypes.c_ubyte * num_pages)()
    assert libc.mincore(ctypes.c_void_p(buffer_tensor.data_ptr() + start), ctypes.c_size_t(stop - start), vec) == 0
    return [bool(v & 1) for v in vec]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise/mincore are Linux's")
def test_pageable_pool_gives_released_pages_back() -> None:
    # Note [Pageable pool pages go back]: a released extent's pages leave the process's memory
    # at once (on CPU the pool is the training's own memory); neighbours keep theirs and their
    # bytes; the space is reused and round-trips exactly.
    mib = 1 << 20
    off = HostOffloader()
    try:
        tensors = [torch.full((mib + 100,), i + 1, dtype=torch.uint8) for i in range(3)]
        tokens = [off.store(t) for t in tensors]
        slab = tokens[0][0]
        host = slab.buffer.tensor
        assert not slab.buffer.pinned and len({t[0] for t in tokens}) == 1
        page = 4096
        # Whole pages inside each extent (the first and the last may be shared with a neighbour).
        inside = [(-(-t[1] // page) * page, (t[1] + slab.extents.rounded(t[2])) // page * page) for t in tokens]
        ends = [t[1] + slab.extents.rounded(t[2]) for t in tokens]
        assert all(all(_resident_pages(host, a, b)) for a, b in inside)
        off.release(tokens[1])
        # Whole pages of the freed extent are gone; the ones it shares with a neighbour stay.
        assert not any(_resident_pages(host, *inside[1])) and inside[1][1] - inside[1][0] > 200 * page
        assert _resident_pages(host, inside[1][0] - page, inside[1][0]) == [True]  # shared with tokens[0]
        assert all(_resident_pages(host, *inside[0])) and all(_resident_pages(host, *inside[2]))
        for t, token in ((tensors[0], tokens[0]), (tensors[2], tokens[2])):  # neighbours intact
            out = torch.empty_like(t)
            off.load(token, out)
            assert torch.equal(out, t)
        again = off.store(tensors[1])  # the freed extent, written to fresh pages
        assert again[1] == tokens[1][1]
        out = torch.empty_like(tensors[1])
        off.load(again, out)
        assert torch.equal(out, tensors[1])
        for token in (tokens[0], again, tokens[2]):
            off.release(token)
        assert sum(_resident_pages(host, 0, ends[2] // page * page)) <= 1  # only a shared edge, if any
    finally:
        off.close()


def test_reserve_zero_gives_back_empty_slabs() -> None:
    # Note [A keep-everything decision holds no offloader memory] in tba/cache/steps/steps.py: the
    # cache calls reserve(0) when its policy offloads nothing; slabs holding a token stay.
    off = HostOffloader()
    try:
        a = off.store(torch.ones(10, dtype=torch.uint8))
        off.reserve(5 << 20)
        off.reserve(0)
        assert off.capacity_bytes > 0  # the slab holds ``a``
        off.release(a)
        off.reserve(0)
        assert off.capacity_bytes == 0
        token = off.store(torch.full((7,), 3, dtype=torch.uint8))  # regrows at the reserved size
        assert off.capacity_bytes == 5 << 20
        out = torch.empty(7, dtype=torch.uint8)
        off.load(token, out)
        assert torch.equal(out, torch.full((7,), 3, dtype=torch.uint8))
    finally:
        off.close()
