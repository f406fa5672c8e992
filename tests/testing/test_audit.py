"""The parity audit (Note [Parity needs moved bytes]) and the wrapper base it shares with the
chaos and corrupting offloaders."""

from __future__ import annotations

import pytest
import torch

from tba.offloaders import HostOffloader, Offloader, TieredOffloader
from tba.testing import FakeOffloader, OffloaderWrapper
from tba.testing._audit import AuditedOffloader


class Keeper(FakeOffloader):
    """Remembers the tensors it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[torch.Tensor] = []

    def store(self, src: torch.Tensor) -> int:
        self.sources.append(src)
        return super().store(src)


@pytest.mark.parametrize("num_bytes", [1, 511, 4097, 3 * 4096 + 5])
def test_store_sees_a_private_copy_inverted_once_stored(num_bytes: int) -> None:
    inner = Keeper()
    audit = AuditedOffloader(inner)
    storage = torch.empty(num_bytes + 100, dtype=torch.uint8)
    src = storage[100:].random_(0, 256)  # at an address that is not page-aligned
    original = src.clone()
    token = audit.store(src)
    handed = inner.sources[0]
    assert handed.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    assert torch.equal(src, original)  # the cache's tensor is untouched
    assert torch.equal(handed, ~original)  # what the offloader kept a reference to is now wrong
    if num_bytes >= 4096:  # same address modulo the page (Note [Reload buffers at the source's page offset])
        assert handed.data_ptr() % 4096 == src.data_ptr() % 4096
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    audit.load(token, dst)
    assert torch.equal(dst, original)  # what the offloader copied out is right
    assert (audit.stored_bytes, audit.loaded_bytes) == (num_bytes, num_bytes)


def test_load_poisons_the_destination_first() -> None:
    class Lazy(FakeOffloader):
        def load(self, token: int, dst: torch.Tensor) -> None:
            pass

    audit = AuditedOffloader(Lazy())
    token = audit.store(torch.zeros(64, dtype=torch.uint8))
    dst = torch.zeros(64, dtype=torch.uint8)
    audit.load(token, dst)
    assert torch.equal(dst, torch.full((64,), 0xA5, dtype=torch.uint8))


def test_inline_stores_are_audited_too() -> None:
    inner = HostOffloader()
    audit = AuditedOffloader(inner)
    assert AuditedOffloader(FakeOffloader()).__dict__.get("store_now") is None  # only when inner has it
    storage = torch.arange(100, dtype=torch.uint8).untyped_storage()
    token = audit.store_now(storage)
    if token is None:  # the pool was empty: a worker store grows it, then inline works
        inner.release(inner.store(torch.zeros(100, dtype=torch.uint8)))
        token = audit.store_now(storage)
    assert token is not None and audit.stored_bytes == 100
    dst = torch.empty(100, dtype=torch.uint8)
    audit.load(token, dst)
    assert torch.equal(dst, torch.arange(100, dtype=torch.uint8))
    audit.close()


def test_wrappers_keep_the_protocol_and_the_optional_parts(tmp_path) -> None:
    from tba.offloaders.ssd import SSDOffloader

    tiered = TieredOffloader(1 << 20, spill=SSDOffloader(dirs=(str(tmp_path),), engine="posix"))
    wrapped = OffloaderWrapper(tiered, "label")
    assert isinstance(wrapped, Offloader) and wrapped.name == f"label({tiered.name})"
    token = wrapped.store(torch.ones(1000, dtype=torch.uint8))
    assert wrapped.used_bytes == tiered.used_bytes > 0
    assert set(wrapped.take_tier_stats()) == set(tiered.tier_names)
    wrapped.release(token)
    wrapped.close()
    assert OffloaderWrapper(FakeOffloader(), "x").used_bytes is None
    assert OffloaderWrapper(FakeOffloader(), "x").take_tier_stats() == {}
