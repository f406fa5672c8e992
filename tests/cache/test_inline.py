"""Small CPU transfers on the training thread (Note [Small transfers inline]): which thread
moves which bytes, the fall-back to the workers, errors in the training step, bit-exactness,
and a second thread wanting an entry another thread is loading."""

from __future__ import annotations

import threading

import pytest
import torch

import tba
from tba.cache.engine import State
from tba.settings import INLINE_MAX_BYTES
from tba.errors import OffloadIOError
from tba.offloaders.host import HostOffloader
from tba.testing import probe
from tests import models
from tests.cache.fakes import bare_engine
from tests.twin import assert_bytes_moved, run_twins

JOIN_S = 30.0


class ThreadRecordingHost(HostOffloader):
    """The host pool, recording the thread of every store_now / store / load."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []
        self.refuse_now = False
        self.fail_now = False
        self.fail_loads = 0

    def store_now(self, storage):
        if self.fail_now:
            raise OSError(5, "injected inline write failure")
        if self.refuse_now:
            return None
        token = super().store_now(storage)
        if token is not None:
            self.calls.append(("store_now", threading.current_thread().name, storage.nbytes()))
        return token

    def store(self, src):
        self.calls.append(("store", threading.current_thread().name, src.numel()))
        return super().store(src)

    def load(self, token, dst):
        if self.fail_loads and threading.current_thread() is threading.main_thread():
            self.fail_loads -= 1  # inline loads only (the first step's worker stores load on workers)
            self.calls.append(("failed load", threading.current_thread().name, dst.numel()))
            raise OSError(5, "injected read failure")
        self.calls.append(("load", threading.current_thread().name, dst.numel()))
        super().load(token, dst)


def options(offloader, **extra):
    return dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
                keep_last_modules=0, adaptive=False, **extra)


def test_small_cpu_transfers_run_on_the_training_thread_and_large_ones_on_workers() -> None:
    """Storages up to INLINE_MAX_BYTES are stored at pack and read back at unpack by the
    training thread; larger ones by the workers. Bit-exact over 3 Adam steps either way."""
    offloader = ThreadRecordingHost()
    # Many rows, narrow blocks: activations above the limit from weights of a few KiB (wide
    # blocks over few rows made Adam's update of 13M parameters most of the test's time).
    rows = 512
    width = INLINE_MAX_BYTES // (4 * rows) + 8  # block activations above the limit ...
    assert rows * 16 * 4 <= INLINE_MAX_BYTES  # ... the input below it
    cache = run_twins(lambda: models.Stack(num_blocks=3, width=width),
                      lambda seed: models.vector_batch(seed, rows=rows),
                      steps=3, settle=True, **options(offloader))
    assert_bytes_moved(cache)
    main = threading.current_thread().name
    inline_stores = [c for c in offloader.calls if c[0] == "store_now"]
    worker_stores = [c for c in offloader.calls if c[0] == "store"]
    main_loads = [c for c in offloader.calls if c[0] == "load" and c[1] == main]
    assert inline_stores and all(t == main and n <= INLINE_MAX_BYTES for _, t, n in inline_stores)
    # Large storages always go through the workers (and small ones while the pool has no room
    # yet: the first step grows it on a worker).
    assert any(n > INLINE_MAX_BYTES for _, _, n in worker_stores)
    assert all(t.startswith("tba-store") for _, t, _ in worker_stores)
    # Every entry stored inline is read back once, inline, by the training thread.
    assert sorted(n for *_, n in main_loads) == sorted(n for *_, n in inline_stores)


@pytest.mark.timing
def test_an_offloader_without_room_now_gets_the_store_on_a_worker() -> None:
    """``store_now`` returning None (no room without growing) sends the store to a worker;
    nothing is lost and the result is bit-exact."""
    offloader = ThreadRecordingHost()
    offloader.refuse_now = True
    cache = run_twins(lambda: models.Stack(num_blocks=3), models.vector_batch, steps=3,
                      settle=True, **options(offloader))
    assert_bytes_moved(cache)
    stores = [thread for kind, thread, _ in offloader.calls if kind == "store"]
    assert stores and all(t.startswith("tba-store") for t in stores)
    assert not [c for c in offloader.calls if c[0] == "store_now"]
    loads = [thread for kind, thread, _ in offloader.calls if kind == "load"]
    assert loads and all(t.startswith("tba-load") for t in loads)  # not inline: stored by a worker


def test_an_inline_store_failure_is_raised_in_the_training_step() -> None:
    offloader = ThreadRecordingHost()
    offloader.fail_now = True
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, **options(offloader)):
        with pytest.raises(OffloadIOError, match="injected inline write failure"):
            model(models.vector_batch(0)).backward()


def test_an_inline_load_failure_is_raised_in_backward_then_a_retry_reads_it() -> None:
    """A failed inline read raises in backward (never wrong gradients); the entry stays
    stored, so running the same graph's backward again (retain_graph) reads it."""
    offloader = ThreadRecordingHost()
    model = models.Stack(num_blocks=3)
    reference = models.Stack(num_blocks=3)
    reference.load_state_dict(model.state_dict())
    x = models.vector_batch(0)
    torch.manual_seed(0)  # the same dropout masks
    reference(x).backward()
    with tba.configure_tensor_cache(model, **options(offloader)) as cache:
        # Small stores fall back to the workers (and then load there) while the host pool has
        # no room, until a worker has grown it: a first step whose stores all complete (and
        # are not cancelled by its backward) grows it; the second step stores inline.
        torch.manual_seed(0)
        warm = model(x)
        cache.wait_for_stores(JOIN_S)
        warm.backward()
        model.zero_grad()
        del offloader.calls[:]
        torch.manual_seed(0)
        loss = model(x)
        cache.wait_for_stores(JOIN_S)
        assert any(c[0] == "store_now" for c in offloader.calls), "nothing was stored inline"
        offloader.fail_loads = 1
        with pytest.raises(OffloadIOError, match="injected read failure"):
            loss.backward(retain_graph=True)
        failed = [c for c in offloader.calls if c[0] == "failed load"]
        assert len(failed) == 1
        model.zero_grad()
        loss.backward()
        stats = cache.stats()
    assert stats.reloaded_bytes > 0
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.timing
def test_a_second_thread_waits_for_an_inline_load_and_gets_the_same_bytes() -> None:
    """The engine alone: thread A reads an inline entry back (held inside ``load``, inside the
    engine's critical section); thread B wants the same entry meanwhile. B waits for A's load
    (no second read) and both get the same storage."""
    gate, started = threading.Event(), threading.Event()

    class GatedHost(HostOffloader):
        num_loads = 0

        def load(self, token, dst):
            GatedHost.num_loads += 1
            started.set()
            assert gate.wait(JOIN_S), "test gate never opened"
            super().load(token, dst)

    offloader = GatedHost()
    offloader.release(offloader.store(torch.zeros(16, dtype=torch.uint8)))  # a slab with room
    engine, handle = bare_engine(offloader, torch.arange(256, dtype=torch.float32))
    entry = handle.entry
    results: dict[str, object] = {}
    threads: list[threading.Thread] = []
    try:
        assert entry.state is State.STORED and entry.xfer.inline  # stored at once, no worker
        a = threading.Thread(target=lambda: results.setdefault("a", engine.fetch(entry)[0]))
        threads.append(a)
        a.start()
        assert started.wait(JOIN_S), "the inline load never started"
        assert entry.state is State.LOADING
        b = threading.Thread(target=lambda: results.setdefault("b", engine.fetch(entry)[0]))
        threads.append(b)
        b.start()
        b.join(0.2)
        assert b.is_alive(), "B did not wait for A's load"
        gate.set()
        a.join(JOIN_S)
        b.join(JOIN_S)
        assert not a.is_alive() and not b.is_alive()
        assert results["a"] is results["b"]
        assert GatedHost.num_loads == 1
        loaded = torch.empty(0, dtype=torch.float32).set_(results["a"])
        assert torch.equal(loaded, torch.arange(256, dtype=torch.float32))
    finally:
        gate.set()
        for thread in threads:
            thread.join(JOIN_S)
        del handle
        entry = None  # the threads' lambdas read this name: release the entry through it
        engine.drain()
        assert engine.table.num_entries == 0 and not engine.held_bytes
        engine.close()
        offloader.close()


@pytest.mark.timing
def test_stores_sent_back_to_the_workers_keep_the_in_flight_bound() -> None:
    """When ``store_now`` has no room, the store goes to the workers under the same
    backpressure as any other: with ``max_inflight_bytes=1`` each store starts with nothing
    else queued or running."""
    offloader = ThreadRecordingHost()
    offloader.refuse_now = True
    seen: list[tuple[int, int]] = []
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, **options(offloader, max_inflight_bytes=1)) as cache:
        view = probe(cache)
        real_store = offloader.store

        def store(src):
            seen.append((view.counters["inflight_bytes"], src.numel()))
            return real_store(src)

        offloader.store = store
        for step in range(2):
            model(models.vector_batch(step)).backward()
    assert len(seen) > 10
    assert all(inflight == n for inflight, n in seen), seen
