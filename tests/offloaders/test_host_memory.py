"""Host pool memory (issue 16, findings 4 and 5): exact requested sizes, pinned outside
PyTorch's power-of-two host allocator, released on reserve and close, a pageable fallback
that warns once, and a ``reserve`` that never allocates on the calling thread.

See Note [Pinned memory outside PyTorch's host allocator] and Note [Reserve off the training
thread]. CUDA is replaced by a fake ``Pinner``; the pools are addressed by the memory kind the
source wants, so ``store_as_cuda`` drives the pinned pool with CPU tensors.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from tba.offloaders import HostOffloader, host as host_module
from tba.offloaders.host_memory import PAGE_BYTES, HostAllocator

MiB = 1 << 20


class FakePinner:
    """Records every (un)registration; fails while ``fail`` is set; ``gate`` blocks register."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.requests: list[int] = []
        self.num_unregistered = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def register(self, ptr: int, num_bytes: int) -> None:
        self.requests.append(num_bytes)
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.fail:
            raise RuntimeError("cudaHostRegister failed: out of memory (2)")
        assert ptr % PAGE_BYTES == 0, "registered ranges must be page-aligned"
        assert ptr not in self.registered, "a range registered twice"
        self.registered[ptr] = num_bytes

    def unregister(self, ptr: int) -> None:
        assert ptr in self.registered, "unregister of a range never registered"
        del self.registered[ptr]
        self.num_unregistered += 1

    @property
    def live_bytes(self) -> int:
        return sum(self.registered.values())


def store_as_cuda(off: HostOffloader, src: torch.Tensor):
    """Store ``src`` into the pinned pool (as for a CUDA source) without a GPU: the pool is
    chosen from the device, so route through ``_allocate`` and the same copy as ``store``."""
    slab, offset = off._allocate(True, src.numel())
    host_module._copy(slab.buffer.tensor[offset : offset + src.numel()], src, non_blocking=False)
    return slab, offset, src.numel()


@pytest.fixture
def pinner() -> FakePinner:
    return FakePinner()


def test_pinned_requests_are_exact_not_powers_of_two(pinner: FakePinner) -> None:
    off = HostOffloader(allocator=HostAllocator(pinner))
    # 70 MiB + 1 byte: PyTorch's host allocator would pin 128 MiB for it.
    src = torch.randint(0, 256, (70 * MiB + 1,), dtype=torch.uint8)
    token = store_as_cuda(off, src)
    slab_bytes = (70 * MiB + 1 + 511) // 512 * 512
    assert pinner.requests == [(slab_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES]
    assert off.pinned_bytes == pinner.live_bytes == pinner.requests[0]
    assert off.capacity_bytes == slab_bytes
    out = torch.empty_like(src)
    off.load(token, out)
    assert torch.equal(out, src)
    off.release(token)
    off.close()
    assert pinner.registered == {} and off.pinned_bytes == 0  # everything unpinned at close


def test_growth_then_reserve_gives_old_slabs_back(pinner: FakePinner) -> None:
    off = HostOffloader(allocator=HostAllocator(pinner))
    sizes = [40 * MiB, 40 * MiB, 60 * MiB, 90 * MiB]  # 230 MiB held at the peak
    tokens = [store_as_cuda(off, torch.zeros(n, dtype=torch.uint8)) for n in sizes]
    grown = pinner.live_bytes
    assert grown >= 230 * MiB and len(pinner.requests) > 1  # grew by slabs
    for token in tokens:
        off.release(token)
    assert pinner.live_bytes == grown  # an empty pool keeps its slabs for the next step

    peak = sum(sizes)
    off.reserve(peak)
    assert pinner.requests[-1] != peak and len(pinner.registered) > 1  # nothing done yet
    tokens = [store_as_cuda(off, torch.zeros(n, dtype=torch.uint8)) for n in sizes]
    assert pinner.requests[-1] == peak  # one slab of exactly the reserved size ...
    assert list(pinner.registered.values()) == [peak]  # ... and nothing else pinned
    assert off.pinned_bytes == peak and off.capacity_bytes == peak
    for token in tokens:
        off.release(token)
    off.close()
    assert pinner.registered == {}


def test_reserve_waits_for_an_empty_pool(pinner: FakePinner) -> None:
    off = HostOffloader(allocator=HostAllocator(pinner))
    held = store_as_cuda(off, torch.zeros(MiB, dtype=torch.uint8))
    off.reserve(200 * MiB)
    other = store_as_cuda(off, torch.zeros(MiB, dtype=torch.uint8))  # pool not empty: no resize
    assert len(pinner.requests) == 1
    off.release(held)
    off.release(other)
    token = store_as_cuda(off, torch.zeros(MiB, dtype=torch.uint8))
    assert pinner.requests[-1] == 200 * MiB and list(pinner.registered.values()) == [200 * MiB]
    off.release(token)
    off.close()


def test_reserve_never_blocks_behind_pinning(pinner: FakePinner) -> None:
    # Note [Reserve off the training thread]: reserve() only records the size; a store worker
    # pinning a slab must not make it wait.
    off = HostOffloader(allocator=HostAllocator(pinner))
    pinner.gate = threading.Event()
    worker = threading.Thread(target=store_as_cuda, args=(off, torch.zeros(MiB, dtype=torch.uint8)))
    worker.start()
    try:
        assert pinner.entered.wait(10), "the store never started pinning"
        done = threading.Event()
        caller = threading.Thread(target=lambda: (off.reserve(500 * MiB), done.set()))
        caller.start()
        assert done.wait(10), "reserve() blocked while a store was pinning memory"
        assert len(pinner.requests) == 1  # reserve allocated nothing itself
        _ = off.capacity_bytes, off.used_bytes  # nor do the counters block
    finally:
        pinner.gate.set()
        worker.join(10)
    assert not worker.is_alive()
    off.close()
    assert pinner.registered == {}


def test_pinning_failure_falls_back_to_pageable_and_warns_once() -> None:
    pinner = FakePinner(fail=True)
    off = HostOffloader(allocator=HostAllocator(pinner))
    src = torch.randint(0, 256, (3 * MiB + 7,), dtype=torch.uint8)
    with pytest.warns(RuntimeWarning, match="pageable memory instead") as caught:
        first = store_as_cuda(off, src)
    assert len(caught) == 1
    assert first[0].buffer.pinned is False and off.num_pin_failures == 1 and off.pinned_bytes == 0
    out = torch.empty_like(src)
    off.load(first, out)  # still a correct round trip
    assert torch.equal(out, src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        off.reserve(100 * MiB)
        off.release(first)
        second = store_as_cuda(off, src)  # a new slab, pinning fails again, silently
    assert off.num_pin_failures == 2 and second[0].buffer.pinned is False
    off.release(second)
    off.close()
    assert pinner.registered == {}


def test_close_releases_slabs_still_holding_extents(pinner: FakePinner) -> None:
    off = HostOffloader(allocator=HostAllocator(pinner))
    token = store_as_cuda(off, torch.zeros(MiB, dtype=torch.uint8))
    assert pinner.live_bytes > 0
    off.close()
    assert pinner.registered == {} and pinner.num_unregistered == 1
    off.release(token)  # after close: a no-op, never a double unregister
    assert pinner.num_unregistered == 1
    with pytest.raises(RuntimeError, match="closed"):
        off.load(token, torch.empty(MiB, dtype=torch.uint8))


def test_pageable_pool_never_pins(pinner: FakePinner) -> None:
    off = HostOffloader(allocator=HostAllocator(pinner))
    token = off.store(torch.ones(5 * MiB, dtype=torch.uint8))  # CPU source: pageable pool
    assert pinner.requests == [] and off.pinned_bytes == 0
    off.release(token)
    off.close()


def test_buffers_are_exact_and_page_aligned() -> None:
    allocator = HostAllocator(FakePinner())
    for num_bytes in (1, 511, 4097, 3 * MiB + 1):
        buf = allocator.allocate(num_bytes, pinned=True)
        assert buf.tensor is not None and buf.tensor.numel() == num_bytes
        assert buf.tensor.data_ptr() % PAGE_BYTES == 0 and buf.pinned
        buf.release()
        buf.release()  # idempotent
        assert buf.released
    assert allocator.pinned_bytes == 0
    with pytest.raises(ValueError, match="num_bytes"):
        allocator.allocate(0, pinned=False)


@pytest.mark.gpu
def test_cuda_host_register_round_trip() -> None:
    from tests.conftest import require_cuda

    require_cuda()
    allocator = HostAllocator()
    buf = allocator.allocate(70 * MiB + 1, pinned=True)
    assert buf.pinned and buf.tensor is not None and buf.tensor.is_pinned()
    src = torch.randint(0, 256, (70 * MiB + 1,), dtype=torch.uint8, device="cuda")
    buf.tensor.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf.tensor.cuda(), src)
    buf.release()
    assert allocator.pinned_bytes == 0


@pytest.mark.gpu
def test_host_offloader_pins_exactly_on_cuda() -> None:
    from tests.conftest import require_cuda

    require_cuda()
    off = HostOffloader()
    src = torch.randint(0, 256, (70 * MiB + 1,), dtype=torch.uint8, device="cuda")
    token = off.store(src)
    assert off.pinned_bytes == (off.capacity_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
    dst = torch.empty_like(src)
    off.load(token, dst)
    assert torch.equal(dst, src)
    off.release(token)
    off.close()
    assert off.pinned_bytes == 0


def test_docstring_examples_run() -> None:
    import doctest

    from tba.offloaders import host, host_memory

    for module in (host, host_memory):
        result = doctest.testmod(module, raise_on_error=False, verbose=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__
