"""``CacheStats.io_cpu_s``: the CPU time transfers take from the host, the offloader's own I/O
threads included; zero when nothing moves."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import tba
from tba.cache.observe.stats import CacheStats
from tba.offloaders.cpu_time import TransferCPU, charge_cpu
from tba.offloaders.ssd import SSDOffloader
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins


def _batch(seed: int) -> torch.Tensor:
    return torch.cat([models.vector_batch(seed * 8 + i) for i in range(8)])


@pytest.mark.timing
@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_io_cpu_is_counted_when_bytes_move(tmp_path: Path, offloader: str) -> None:
    options = {"ssd_engine": "posix", "ssd_dirs": (str(tmp_path),)} if offloader == "ssd" else {}
    cache = run_twins(
        lambda: models.Stack(num_blocks=3, width=128), _batch, steps=3, settle=True, offloader=offloader,
        offload_devices=("cpu",), min_offload_bytes=0, adaptive=False, keep_last_modules=0,
        prefetch_modules=0, **options,
    )
    total = assert_bytes_moved(cache)
    assert total.io_cpu_s > 0 and total.io_cpu_s_per_gb > 0
    steps = [stats for _, stats, _ in probe(cache).history]
    assert len(steps) == 3 and all(s.io_cpu_s > 0 for s in steps)
    assert total.io_cpu_s == pytest.approx(sum(s.io_cpu_s for s in steps))  # merged by summing
    assert "I/O CPU" in str(total) and "I/O CPU ms" in cache.summary()


def test_io_cpu_is_zero_without_an_offloader() -> None:
    cache = run_twins(
        lambda: models.Stack(num_blocks=3, width=128), _batch, steps=3, offloader="none",
        offload_devices=("cpu",), min_offload_bytes=0, adaptive=False,
    )
    total = cache.stats(cumulative=True)
    assert total.num_steps == 3 and total.offloaded_bytes == total.reloaded_bytes == 0
    assert total.io_cpu_s == 0.0 and total.io_cpu_s_per_gb == 0.0


def test_transfer_cpu_adds_what_other_threads_charge() -> None:
    charge_cpu(100.0)  # outside any transfer: ignored
    with TransferCPU() as outer:
        charge_cpu(2.0)
        with TransferCPU() as inner:
            charge_cpu(3.0)
        charge_cpu(0.5)
    assert 3.0 <= inner.seconds < 3.5
    assert 2.5 <= outer.seconds < 3.0  # the inner transfer's charge is the inner one's
    seen: list[float] = []

    def other_thread() -> None:  # an account is per thread
        with TransferCPU() as mine:
            pass
        seen.append(mine.seconds)

    with TransferCPU() as account:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert seen and seen[0] < 1.0 and account.seconds < 1.0


def test_the_posix_engine_charges_its_io_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces run on the engine's I/O pool: their CPU time is charged to the calling transfer."""
    from tba.offloaders.ssd import _posix

    charged: list[float] = []
    monkeypatch.setattr(_posix, "charge_cpu", lambda seconds: (charged.append(seconds), charge_cpu(seconds)))
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", chunk_bytes=1 << 20, slab_bytes=8 << 20)
    try:
        src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
        with TransferCPU() as store:
            token = off.store(src)
        assert len(charged) >= 4 and all(c > 0 for c in charged)  # one per piece on the pool
        assert store.seconds >= sum(charged)
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src)
    finally:
        off.close()


def test_stats_text_shows_io_cpu() -> None:
    stats = CacheStats(num_steps=1, offloaded_bytes=10**9, reloaded_bytes=10**9, io_cpu_s=0.5).merged(CacheStats())
    assert stats.io_cpu_s_per_gb == pytest.approx(0.25)
    assert "I/O CPU       500.0 ms on transfer threads, 0.250 s per GB moved" in str(stats)


class _BurningOffloader:
    """Keeps bytes in memory and spends exactly-at-least ``burn_s`` of CPU per store and load."""

    name = "burning"

    def __init__(self, burn_s: float) -> None:
        self.burn_s = burn_s
        self.num_stores = self.num_loads = 0

    def _burn(self) -> None:
        start = time.thread_time()
        while time.thread_time() - start < self.burn_s:
            pass

    def store(self, src: torch.Tensor) -> torch.Tensor:
        self._burn()
        self.num_stores += 1
        return src.clone()

    def load(self, token: torch.Tensor, dst: torch.Tensor) -> None:
        self._burn()
        self.num_loads += 1
        dst.copy_(token)

    def release(self, token: torch.Tensor) -> None:
        pass

    def reserve(self, num_bytes: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.timing
def test_both_stores_and_loads_are_counted() -> None:
    offloader = _BurningOffloader(burn_s=0.005)
    cache = run_twins(
        lambda: models.Stack(num_blocks=2, width=64), models.vector_batch, steps=3, settle=True,
        offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0, adaptive=False,
        keep_last_modules=0, prefetch_modules=0,
    )
    total = assert_bytes_moved(cache)
    assert offloader.num_stores > 0 and offloader.num_loads > 0
    assert total.io_cpu_s >= offloader.burn_s * (offloader.num_stores + offloader.num_loads)


class _BurningInlineOffloader(_BurningOffloader):
    """Takes small CPU storages at once on the training thread (Note [Small transfers inline])."""

    def store_now(self, storage: torch.UntypedStorage) -> torch.Tensor:
        self._burn()
        self.num_stores += 1
        return torch.empty(0, dtype=torch.uint8).set_(storage).clone()


def test_inline_stores_and_loads_are_counted() -> None:
    offloader = _BurningInlineOffloader(burn_s=0.005)
    cache = run_twins(
        lambda: models.Stack(num_blocks=2, width=64), models.vector_batch, steps=3, settle=True,
        offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0, adaptive=False,
        keep_last_modules=0, prefetch_modules=0,
    )
    total = assert_bytes_moved(cache)
    assert offloader.num_stores > 0 and offloader.num_loads > 0
    assert total.io_cpu_s >= offloader.burn_s * (offloader.num_stores + offloader.num_loads)
