"""The storages of offloaded activations are really freed before forward ends, told from
outside the cache: finalizers on the storages (``tba.testing.StorageWatch``), not the cache's
own count, which reads low also when a stray reference keeps every storage alive."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tba
from tba.testing import StorageWatch, probe
from tba.testing import _liveness
from tests import models
from tests.twin import assert_bytes_moved, forward_loss, run_twins

NUM_BLOCKS = 8
KEEP_LAST = 1


def _batch(seed: int) -> torch.Tensor:
    return torch.cat([models.vector_batch(seed * 8 + i) for i in range(8)])


def _options(offloader: str, tmp_path: Path) -> dict[str, Any]:
    """Forced offloading of every block but the kept tail, whatever the tensors' size."""
    options: dict[str, Any] = dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                                   adaptive=False, keep_last_modules=KEEP_LAST)
    if offloader == "ssd":
        options.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    return options


class _Watched:
    """The forward of both twins: the output of each block's ``up`` (a tensor only that
    block's GELU saves for backward) watched, and which of them are alive read in a pre-hook
    of the head, when every block has run and forward has not returned. The tba twin's stores
    are completed there first, so what is alive does not depend on the store thread's speed."""

    def __init__(self) -> None:
        self.watch = StorageWatch()
        self.alive: dict[str, list[list[str]]] = {"reference": [], "tba": []}
        self.resident_bytes: list[int] = []  # the cache's own count at the same moment

    def __call__(self, net: nn.Module, batch: Any) -> torch.Tensor:
        cache = tba.get_tensor_cache(net)
        watch = self.watch
        watch.clear()

        def at_head(module: nn.Module, args: Any) -> None:
            if cache is not None:
                cache.wait_for_stores(60)
                self.resident_bytes.append(probe(cache).counters["resident_bytes"])
            self.alive["reference" if cache is None else "tba"].append(watch.alive)

        blocks = {f"blocks.{i}": block.up for i, block in enumerate(net.blocks)}
        handle = net.head.register_forward_pre_hook(at_head)
        try:
            with watch.outputs_of(blocks):
                loss = forward_loss(net, batch)
        finally:
            handle.remove()
        assert watch.num_watched == len(blocks), watch
        return loss


def _kept_blocks(cache: tba.TensorCache) -> list[str]:
    """The blocks whose saves stay in memory, from the cache's configuration: with a fixed
    boundary the last ``keep_last_modules`` blocks (every block without an offloader)."""
    first_kept = 0 if cache.config.offloader == "none" else max(0, cache.num_blocks - cache.config.keep_last_modules)
    return [f"blocks.{i}" for i in range(first_kept, cache.num_blocks)]


@pytest.mark.parametrize("offloader", ["none", "host", "ssd"])
def test_offloaded_storages_are_freed_before_forward_ends(offloader: str, tmp_path: Path) -> None:
    forward = _Watched()
    cache = run_twins(lambda: models.Stack(num_blocks=NUM_BLOCKS, width=64), _batch, steps=3, forward=forward,
                      **_options(offloader, tmp_path))
    every_block = [f"blocks.{i}" for i in range(NUM_BLOCKS)]
    assert cache.num_blocks == NUM_BLOCKS
    # Without tba every block's activation lives until backward: the watch sees storages die.
    assert forward.alive["reference"] == [every_block] * 3
    kept = _kept_blocks(cache)
    assert forward.alive["tba"] == [kept] * 3, (
        f"storages alive when forward ends, per step: {forward.alive['tba']}; expected only the kept "
        f"blocks {kept}; the cache's own count of resident bytes then: {forward.resident_bytes}")
    if offloader == "none":
        assert kept == every_block
        assert cache.stats(cumulative=True).offloaded_bytes == 0
        return
    assert len(kept) == KEEP_LAST
    total = assert_bytes_moved(cache)  # the stores completed and backward read them back
    # Every step stored at least the watched activations of the offloaded blocks.
    up_bytes = 2 * 64 * _batch(0).shape[0] * 4
    assert total.offloaded_bytes >= 3 * (NUM_BLOCKS - KEEP_LAST) * up_bytes, total


def test_the_watch_sees_what_autograd_holds() -> None:
    """The docstring's example runs; a storage stays alive while autograd or the test holds
    it and dies with the last reference."""
    result = doctest.testmod(_liveness, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
    watch = StorageWatch()
    x = torch.randn(8, requires_grad=True)
    with watch.saved_tensors():
        y = (x * 3).exp()  # exp saves its result: y's own storage
    loss = y.sum()
    held = y[2:].detach()
    assert watch.watch(y, "again") is False  # one storage, watched once
    del y
    assert (watch.num_watched, watch.num_alive) == (1, 1)
    loss.backward()  # autograd lets go of the saved result; the view still holds the storage
    del loss
    assert watch.num_alive == 1 and watch.alive_bytes == 8 * 4
    del held
    assert watch.num_alive == 0
    watch.clear()
    assert (watch.num_watched, watch.num_alive, watch.alive_bytes) == (0, 0, 0)
