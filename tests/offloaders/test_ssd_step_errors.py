"""Errors of the SSD offloader reach the training step, and interruptions leave it usable:
a failed end-of-step reservation, a caught Ctrl-C; path-like ``ssd_dirs``."""

from __future__ import annotations

import errno
import gc
import warnings
from pathlib import Path

import pytest
import torch

import tba
from tba.offloaders.ssd._slabs import SlabDir
from tests import models
from tests.offloaders.ssd_helpers import run_python

_OPTIONS = dict(
    offloader="ssd", ssd_engine="posix", offload_devices=("cpu",), min_offload_bytes=0, adaptive=False,
    keep_last_modules=0, prefetch_modules=0,
)


def _step(model: torch.nn.Module, cache: tba.TensorCache, seed: int) -> None:
    loss = model(models.vector_batch(seed))
    cache.wait_for_stores(timeout_s=60)
    loss.backward()


@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_reservation_enospc_reaches_the_training_step(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=4, width=128)
    cache = tba.configure_tensor_cache(model, ssd_dirs=(tmp_path,), on_io_error=mode, **_OPTIONS)
    try:
        # The drive fills up while step 1 runs: the reservation at its end (adaptive=False:
        # after the first step) finds too little space.
        monkeypatch.setattr(SlabDir, "shortfall", lambda self, num_bytes: (64 << 20, 1 << 20))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model, cache, 0)  # the reservation runs when step 1's last tensor is freed
            assert cache.stats().offloaded_bytes > 0 and cache.stats().reloaded_bytes > 0
            if mode == "raise":
                with pytest.raises(tba.OffloadIOError) as info:
                    _step(model, cache, 1)
                assert info.value.errno == errno.ENOSPC
                assert "not enough free disk space" in str(info.value) and "ssd_dirs" in str(info.value)
                del info
            else:
                _step(model, cache, 1)  # that tensor is kept in memory, with one warning
                kept = [w for w in caught if "not enough free disk space" in str(w.message)]
                assert len(kept) == 1 and "on_io_error='keep'" in str(kept[0].message)
        _step(model, cache, 2)  # raised once: training goes on
        # The failed step ends when its tensors die. The exception's traceback holds them, and the
        # cache's store thread keeps the exception until its next store (in step 2), in a
        # reference cycle: collect it, then finish one more step. (Cache-side: see the issue 12
        # closing note.)
        gc.collect()
        _step(model, cache, 3)
        assert cache.stats(cumulative=True).num_io_errors == 1  # counted in both modes
    finally:
        cache.close()


def test_caught_keyboard_interrupt_leaves_the_offloader_usable(tmp_path: Path) -> None:
    code = f"""
        import os, signal, torch
        from tba.offloaders.ssd import SSDOffloader
        off = SSDOffloader(dirs=[{str(tmp_path)!r}], engine="posix", slab_bytes=1 << 20)
        src = torch.arange(100_000, dtype=torch.int64).view(torch.uint8)
        token = off.store(src)
        try:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, through the real signal machinery
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src) and os.path.isdir(off.directories[0])
        off.store(src)
        print(off.directories[0], flush=True)
        signal.raise_signal(signal.SIGINT)  # uncaught this time: nothing may be left behind
        """
    result = run_python(code, cwd=tmp_path, timeout_s=60, check=False)
    lines = result.stdout.split()
    assert lines[:1] == ["interrupted"] and len(lines) == 2, (result.stdout, result.stderr)
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_caught_keyboard_interrupt_then_bit_exact_training(tmp_path: Path) -> None:
    """Note [Interrupted forwards]: a Ctrl-C inside forward skips torch's always_call hooks;
    the next forward closes the interrupted one and training goes on bit-exact."""
    code = f"""
        import copy, gc, signal, torch, tba
        from tests import models
        torch.manual_seed(0)
        reference = models.Stack(num_blocks=4, width=128)
        model = copy.deepcopy(reference)
        opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        cache = tba.configure_tensor_cache(
            model, offloader="ssd", ssd_engine="posix", ssd_dirs=({str(tmp_path)!r},), offload_devices=("cpu",),
            min_offload_bytes=0, adaptive=False, keep_last_modules=0, prefetch_modules=0)

        def interrupt(module, args, output):
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of the forward

        handle = model.blocks[2].register_forward_hook(interrupt)
        try:
            model(models.vector_batch(99)).backward()
        except KeyboardInterrupt:
            pass
        handle.remove()
        gc.collect()  # the interrupted forward's frames (a reference cycle) held its tensors
        for step in range(3):
            losses = []
            for net, optimizer in ((reference, opt_ref), (model, opt)):
                optimizer.zero_grad(set_to_none=True)
                torch.manual_seed(step)  # same dropout masks in both
                loss = net(models.vector_batch(step))
                if net is model:
                    cache.wait_for_stores(timeout_s=60)
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), step
            for a, b in zip(reference.parameters(), model.parameters()):
                assert torch.equal(a.grad, b.grad), step
            opt_ref.step()
            opt.step()
            last = cache.stats()
            assert last.offloaded_bytes > 0 and last.reloaded_bytes > 0, (step, last)
        # The interrupted forward is no step (Note [Step boundaries]): the three that ran.
        assert cache.stats(cumulative=True).num_steps == 3, cache.stats(cumulative=True)
        cache.close()
        """
    run_python(code, cwd=tmp_path, timeout_s=120)
    assert list(tmp_path.iterdir()) == []


def test_pathlike_ssd_dirs(tmp_path: Path) -> None:
    from tests.twin import run_twins

    drives = [tmp_path / "a", tmp_path / "b"]
    for d in drives:
        d.mkdir()
    assert tba.TensorCacheConfig(ssd_dirs=drives).ssd_dirs == tuple(map(str, drives))
    assert tba.TensorCacheConfig(ssd_dirs=drives[0]).ssd_dirs == (str(drives[0]),)
    cache = run_twins(lambda: models.Stack(num_blocks=4, width=128), models.vector_batch, steps=3,
                      settle=True, ssd_dirs=drives, **_OPTIONS)
    total = cache.stats(cumulative=True)
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0
    assert all(list(d.iterdir()) == [] for d in drives)
