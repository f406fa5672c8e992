"""Training with ``offloader="host+ssd"``: bit-exact over Adam steps with both tiers really
used, per-tier stats in ``stats()`` and ``summary()``, SSD-tier errors in the training step,
files removed on close."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import pytest
import torch

import tba
from tba.offloaders.ssd._slabs import SlabDir
from tba.testing import probe
from tests import models
from tests.offloaders.ssd_helpers import tamper_every_extent
from tests.twin import assert_bytes_moved, run_twins

_BUDGET = 20_000  # bytes: a few of the Stack's 4-8 KiB activations; the rest spills
_OPTIONS = dict(
    offloader="host+ssd", ssd_engine="posix", offload_devices=("cpu",), min_offload_bytes=0,
    host_budget_bytes=_BUDGET,
)


def _stack() -> torch.nn.Module:
    return models.Stack(num_blocks=4, width=128)


def _check_tiers(cache: tba.TensorCache, budget: int) -> None:
    total = assert_bytes_moved(cache)
    host, ssd = total.tiers["host"], total.tiers["ssd"]
    assert host.stored_bytes > 0 and ssd.stored_bytes > 0, total.tiers  # both tiers were used
    assert host.stored_bytes + ssd.stored_bytes == total.offloaded_bytes
    assert host.num_stored + ssd.num_stored == total.num_offloaded
    assert 0 < host.peak_held_bytes <= budget and host.budget_bytes == budget
    assert host.num_over_budget + host.num_no_room == ssd.num_stored
    assert host.held_bytes == 0 and ssd.held_bytes == 0  # every step released everything
    assert total.num_io_errors == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_stack_bit_exact_with_both_tiers(tmp_path: Path, adaptive: bool) -> None:
    cache = run_twins(
        _stack, models.vector_batch, steps=4, settle=True, ssd_dirs=(str(tmp_path),), adaptive=adaptive,
        keep_last_modules=0, **_OPTIONS,
    )
    _check_tiers(cache, _BUDGET)
    assert cache.offloader.name == "host+ssd"
    # Every step spilled: the per-step tiers are the offloader's counters of that step.
    for _, step, _ in probe(cache).history:
        assert step.tiers["host"].stored_bytes + step.tiers["ssd"].stored_bytes == step.offloaded_bytes
    summary = cache.summary()
    assert "placement: host held up to" in summary and "budget" in summary
    assert "spilled to ssd because the host tier was full" in summary
    assert "tier host" in str(cache.stats()) and "tier ssd" in str(cache.stats())
    assert list(tmp_path.iterdir()) == []  # the cache closed the offloader: spill files gone


def test_gpt2_bit_exact_with_both_tiers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    budget = 64 << 10
    options = dict(_OPTIONS, host_budget_bytes=budget)
    cache = run_twins(models.gpt2, models.lm_batch, steps=3, settle=True, ssd_dirs=(str(tmp_path),), **options)
    _check_tiers(cache, budget)
    assert list(tmp_path.iterdir()) == []


def _step(model: torch.nn.Module, cache: tba.TensorCache, seed: int) -> None:
    loss = model(models.vector_batch(seed))
    cache.wait_for_stores(timeout_s=60)
    loss.backward()


def _configure(tmp_path: Path, **extra: object) -> tuple[torch.nn.Module, tba.TensorCache]:
    torch.manual_seed(0)
    model = _stack()
    options = dict(_OPTIONS, adaptive=False, keep_last_modules=0, prefetch_modules=0, **extra)
    return model, tba.configure_tensor_cache(model, ssd_dirs=(str(tmp_path),), **options)


def test_ssd_tier_write_error_is_raised_in_the_training_step(tmp_path: Path) -> None:
    model, cache = _configure(tmp_path)
    try:
        engine = cache.offloader.spill._engine

        def fail(*args: object) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        engine._pwrite = fail
        with pytest.raises(tba.OffloadIOError) as info:
            _step(model, cache, 0)
        assert info.value.errno == errno.EIO and info.value.path is not None
        assert info.value.path.startswith(str(tmp_path))  # from the SSD tier, not the host pool
        del info
    finally:
        cache.close()
    gc.collect()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_ssd_tier_corruption_is_raised_in_backward(tmp_path: Path, mode: str) -> None:
    model, cache = _configure(tmp_path, on_io_error=mode)
    try:
        loss = model(models.vector_batch(0))
        cache.wait_for_stores(timeout_s=60)
        assert cache.offloader.tier_stats()["host"].held_bytes > 0  # some tensors are in host memory
        assert tamper_every_extent(cache.offloader.spill) > 0  # and some on the SSD tier
        with pytest.raises(tba.OffloadIOError, match="changed since it was written"):
            loss.backward()
    finally:
        cache.close()
    assert list(tmp_path.iterdir()) == []


def test_ssd_tier_reservation_enospc_reaches_the_training_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, cache = _configure(tmp_path)
    try:
        # The drive fills up during step 1: the reservation at its end (the part of the
        # step's peak over the host budget goes to the SSD tier) finds too little space.
        monkeypatch.setattr(SlabDir, "shortfall", lambda self, num_bytes: (64 << 20, 1 << 20))
        _step(model, cache, 0)
        assert cache.stats().tiers["ssd"].stored_bytes > 0
        with pytest.raises(tba.OffloadIOError) as info:
            _step(model, cache, 1)
        assert info.value.errno == errno.ENOSPC and "not enough free disk space" in str(info.value)
        del info
        gc.collect()
        _step(model, cache, 2)  # raised once: training goes on, with both tiers
        _step(model, cache, 3)
        last = cache.stats()
        assert last.tiers["host"].stored_bytes > 0 and last.tiers["ssd"].stored_bytes > 0
        assert last.reloaded_bytes > 0
    finally:
        cache.close()
    assert list(tmp_path.iterdir()) == []
