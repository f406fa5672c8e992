"""The transfer state machine driven deterministically: forwarding, cancellation, prefetch,
backpressure, stream ordering and I/O errors (Note [Transfer ordering])."""

from __future__ import annotations

import threading
import weakref
import warnings

import pytest
import torch

import tba
from tba.cache.tensor_cache import TensorCache
from tests import models
from tests.cache.fakes import FakeOffloader, RecordingStreams, bare_engine
from tests.twin import assert_bytes_moved, run_twins


def make_cache(model, offloader, streams=None, **options) -> TensorCache:
    options = {"offload_devices": ("cpu",), "min_offload_bytes": 0, "keep_last_modules": 0,
               "adaptive": False, **options}
    config = tba.TensorCacheConfig(offloader=offloader, **options)
    return TensorCache(model, config, offloader, streams=streams)


def _settled_step(streams: RecordingStreams, offloader: FakeOffloader | None = None) -> tba.CacheStats:
    """One step of a 4-block stack over ``streams``: every store finishes before backward, so
    backward has to load."""
    model = models.Stack(num_blocks=4)
    cache = make_cache(model, offloader or FakeOffloader(), streams, prefetch_modules=0)
    loss = model(models.vector_batch(0))
    cache.wait_for_stores(60)
    loss.backward()
    stats = cache.stats()
    cache.close()
    assert stats.num_offloaded > 0 and stats.reloaded_bytes > 0
    return stats


@pytest.mark.timing
def test_stream_ordering_of_stores_and_loads() -> None:
    streams = RecordingStreams()
    offloader = FakeOffloader()
    stats = _settled_step(streams, offloader)
    log = streams.log
    producers = [e[1] for e in log if e[0] == "record" and e[1][0] == "producer"]
    store_waits = [e[2] for e in log if e[0] == "enter" and e[1] == "store"]
    # 1. Every store waited on the event recorded when its tensor was packed, in pack order.
    assert store_waits == producers[: len(store_waits)] and len(store_waits) == stats.num_offloaded
    main = threading.get_ident()
    assert all(e[2] == main for e in log if e[0] == "record" and e[1][0] == "producer")
    assert all(e[3] != main for e in log if e[0] == "enter")
    # 2. Loads record their event inside the load context, on the worker.
    loaded = [e[1] for e in log if e[0] == "record" and e[1][0] == "loaded"]
    assert len(loaded) == offloader.num_loads > 0
    # 3. The training thread consumes each loaded event before autograd uses the tensor,
    #    and only after the load recorded it.
    consumed = [(i, e) for i, e in enumerate(log) if e[0] == "consume"]
    assert consumed and all(e[3] == main for _, e in consumed)
    for i, e in consumed:
        recorded_at = next(j for j, f in enumerate(log) if f[0] == "record" and f[1] == e[1])
        assert recorded_at < i
    assert {e[1] for _, e in consumed} == set(loaded)


@pytest.mark.timing
def test_forwarding_serves_in_flight_store_without_read() -> None:
    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, offloader)
    loss = model(models.vector_batch(0))
    assert offloader.store_started.acquire(timeout=10)  # one store is running, the rest queued
    # Backward needs the tensors while the first store is still held at the gate: all served
    # from memory, the queued stores cancelled, nothing read. Backward never waits for a
    # running store (if it did, the gate's own 30 s bound fails the store and the test).
    loss.backward()
    stats = cache.stats()
    offloader.gate.set()  # only now can the running store finish
    cache.close()
    assert offloader.num_loads == 0
    assert stats.reloaded_bytes == 0
    assert stats.num_forwarded == stats.num_packed - stats.num_deduplicated
    assert stats.num_cancelled >= stats.num_packed - 2
    assert stats.num_offloaded <= 1
    assert not offloader.blobs  # the one finished store was released


@pytest.mark.timing
def test_prefetch_serves_every_reload_with_unthrottled_offloader() -> None:
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=6)
    cache = make_cache(model, offloader, prefetch_modules=2)
    for step in range(3):
        loss = model(models.vector_batch(step))
        cache.wait_for_stores(60)
        loss.backward()
        assert cache.stats().reloaded_bytes > 0
    cache.close()
    assert offloader.closed and not offloader.blobs
    assert offloader.reserved, "the pool was never sized from the first step"


@pytest.mark.timing
def test_unpack_of_stored_entry_loads_synchronously_and_counts_it() -> None:
    from tba.cache.engine import State

    offloader = FakeOffloader()
    data = torch.arange(4097, dtype=torch.int64).view(torch.uint8).clone()
    saved = data.clone()
    engine, handle = bare_engine(offloader, saved, max_inflight_bytes=1 << 20)
    entry = handle.entry
    del saved
    engine.wait_for_stores(60)
    assert entry.state is State.STORED
    assert entry.data is None and engine.resident_bytes == 0
    loaded, _ = engine.fetch(entry)  # nobody prefetched it
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(loaded), data)
    assert engine.step.num_sync_loads == 1 and engine.step.reloaded_bytes == data.numel()
    loaded, _ = engine.fetch(entry)  # READY now: no second read
    assert offloader.num_loads == 1
    del handle, entry, loaded
    engine.drain()
    assert offloader.released == [0] and engine.resident_bytes == 0 and not engine.check()
    engine.close()


@pytest.mark.timing
def test_inflight_bytes_bound_applies_backpressure() -> None:
    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    model = models.Stack(num_blocks=4, width=64)
    cache = make_cache(model, offloader, max_inflight_bytes=1)
    result: list[torch.Tensor] = []
    forward = threading.Thread(target=lambda: result.append(model(models.vector_batch(0))),
                               daemon=True)
    forward.start()
    try:
        assert offloader.store_started.acquire(timeout=30), "no store started"
        # With room for one store at a time and that store held at the gate, forward cannot
        # finish: it waits in its next pack. (A correct cache never gets past this point, so
        # this wait cannot fail it; it only bounds how long a broken one is given.)
        forward.join(0.5)
        assert forward.is_alive(), "forward finished while the only allowed store was held"
        assert offloader.num_stores == 0
    finally:
        offloader.gate.set()
    forward.join(60)
    assert not forward.is_alive(), "forward still blocked 60 s after the store was released"
    (loss,) = result
    cache.wait_for_stores(60)
    loss.backward()
    stats = cache.stats()
    cache.close()
    assert stats.store_wait_s > 0  # the wait is accounted
    assert stats.num_offloaded == offloader.num_stores > 1


@pytest.mark.parametrize("where", ["store", "load"])
def test_io_error_raises_in_training_step(where: str) -> None:
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=3)
    # max_inflight_bytes=1: each new entry waits for the store before it, so a failed store
    # is seen by the very forward that queued it.
    cache = make_cache(model, offloader, prefetch_modules=0, max_inflight_bytes=1)
    offloader.fail_store = where == "store"
    phase = "forward"
    with pytest.raises(tba.OffloadIOError) as info:
        loss = model(models.vector_batch(0))
        phase = "wait"
        cache.wait_for_stores(60)  # every store finished: backward has to load
        offloader.fail_load = where == "load"
        phase = "backward"
        loss.backward()
        phase = "none"
    assert phase == ("forward" if where == "store" else "backward")
    message = str(info.value)
    assert "injected" in message
    if where == "store":
        assert info.value.errno is not None and "path=/fake" in message
    cache.close()


def test_io_error_keep_warns_once_and_stays_bit_exact() -> None:
    offloader = FakeOffloader()
    offloader.fail_store = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = run_twins(models.Stack, models.vector_batch, steps=3, settle=True, offloader=offloader,
                          offload_devices=("cpu",), min_offload_bytes=0, on_io_error="keep")
    relevant = [w for w in caught if "on_io_error='keep'" in str(w.message)]
    assert len(relevant) == 1
    total = cache.stats(cumulative=True)
    assert total.num_io_errors > 0 and total.offloaded_bytes == 0


def test_custom_offloader_bit_exact_and_released() -> None:
    offloader = FakeOffloader()
    cache = run_twins(models.gpt2, models.lm_batch, steps=3, settle=True, offloader=offloader,
                      offload_devices=("cpu",), min_offload_bytes=0)
    assert_bytes_moved(cache)
    assert offloader.num_stores > 0 and offloader.num_loads > 0
    assert offloader.closed and not offloader.blobs


class _WaitingStreams(RecordingStreams):
    """A stream layer whose devices run behind the CPU: entering a transfer waits ``lag_s`` (on a
    fake clock) for the producer, as a GPU store waits for the kernel that made its tensor."""

    def __init__(self, clock: "_FakePerfCounter", lag_s: float) -> None:
        super().__init__()
        self.clock, self.lag_s = clock, lag_s

    def transfer(self, device, kind, wait_for):  # type: ignore[no-untyped-def]
        context = super().transfer(device, kind, wait_for)

        class Waiting:
            def __enter__(inner) -> None:
                context.__enter__()
                self.clock.advance(self.lag_s)

            def __exit__(inner, *exc) -> None:  # type: ignore[no-untyped-def]
                context.__exit__(*exc)

        return Waiting()


class _FakePerfCounter:
    """The ``time`` module, but ``perf_counter`` runs ahead by what ``advance`` added."""

    def __init__(self) -> None:
        import time

        self._time, self._offset, self._lock = time, 0.0, threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds

    def perf_counter(self) -> float:
        with self._lock:
            return self._time.perf_counter() + self._offset

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._time, name)


def test_transfer_time_excludes_the_wait_for_the_producer(monkeypatch) -> None:
    """Note [Transfer time is the copy's]: a store or load whose stream waits 100 s for its
    producer (or for the reload buffer's allocation) counts only the copy in ``write_s`` /
    ``read_s``, so the bandwidth the policy decides from is the copy's."""
    from tba.cache.engine import workers

    clock = _FakePerfCounter()
    monkeypatch.setattr(workers, "time", clock)
    streams = _WaitingStreams(clock, lag_s=100.0)
    stats = _settled_step(streams)
    entered = sum(1 for e in streams.log if e[0] == "enter")
    assert entered >= stats.num_offloaded + 1  # every store and at least one load waited 100 s
    assert stats.write_s < 50.0, f"write_s {stats.write_s:.1f} s counts the wait for the producer"
    assert stats.read_s < 50.0, f"read_s {stats.read_s:.1f} s counts the wait for the allocation"
