"""A cache dropped without ``close()`` is collected and releases everything (issue 10, item 6):
the cache object dies, tba's store and load threads stop and, for the SSD offloader, its private
directory is removed."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from pathlib import Path

import pytest

import tba
from tests import models

TIMEOUT_S = 30.0


def tba_threads(exclude: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in exclude and t.name.startswith(("tba-store-", "tba-load-"))]


@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_unclosed_cache_is_collected(offloader: str, tmp_path: Path) -> None:
    existing = set(threading.enumerate())
    extra = dict(ssd_dirs=(str(tmp_path),), ssd_engine="posix") if offloader == "ssd" else {}
    model = models.Stack(num_blocks=3)
    cache = tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                       min_offload_bytes=0, keep_last_modules=0, adaptive=False,
                                       **extra)
    for step in range(2):
        loss = model(models.vector_batch(step))
        cache.wait_for_stores(TIMEOUT_S)
        loss.backward()
    stats = cache.stats(cumulative=True)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
    ours = tba_threads(existing)
    assert ours, "the cache started no tba-store-*/tba-load-* thread"
    directories = list(cache.offloader.directories) if offloader == "ssd" else []
    assert all(os.path.isdir(d) for d in directories) and directories == [
        d for d in directories if Path(d).parent == tmp_path]
    collected = weakref.ref(cache)
    model_collected = weakref.ref(model)

    del cache, model, loss
    gc.collect()

    assert model_collected() is None, "the model is still referenced after del + gc.collect()"
    assert collected() is None, (
        "the TensorCache is still referenced after del + gc.collect(): "
        f"{[type(r).__name__ for r in gc.get_referrers(collected())]}"
    )
    deadline = time.monotonic() + TIMEOUT_S
    for thread in ours:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in ours if t.is_alive()]
    assert not alive, f"tba threads still running {TIMEOUT_S:g} s after the cache was collected: {alive}"
    leftover = [d for d in directories if os.path.exists(d)]
    assert not leftover, f"private SSD directories left after the cache was collected: {leftover}"


def test_collected_cache_leaves_the_registry() -> None:
    from tba.integrations import registry

    gc.collect()
    before = len(registry.registered())
    model = models.Stack(num_blocks=2)
    cache = tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0)
    model(models.vector_batch(0)).backward()
    assert len(registry.registered()) == before + 1
    collected = weakref.ref(cache)
    del cache, model
    gc.collect()
    assert collected() is None, "the TensorCache is still referenced after del + gc.collect()"
    assert len(registry.registered()) == before
    # The next model configures normally.
    other = models.Stack(num_blocks=2)
    with tba.configure_tensor_cache(other, offload_devices=("cpu",), min_offload_bytes=0) as again:
        other(models.vector_batch(1)).backward()
        assert again.stats().num_packed > 0
