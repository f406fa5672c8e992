"""The engine's state machine under gated fakes: forwarding of a running store, the in-flight
budget when graphs die with queued stores, prefetch order and look-ahead, close() and live
graphs, and the invariant check (Note [Cache invariants])."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import tba
from tba.cache.tensor_cache import TensorCache
from tba.testing import probe
from tests import models
from tests.cache.fakes import FakeOffloader, bare_engine
from tests.waits import wait_until

JOIN_S = 30.0


def make_cache(model: nn.Module, offloader, **options) -> TensorCache:
    options = {"offload_devices": ("cpu",), "min_offload_bytes": 0, "keep_last_modules": 0,
               "adaptive": False, **options}
    return TensorCache(model, tba.TensorCacheConfig(offloader=offloader, **options), offloader)


class RecordingOffloader(FakeOffloader):
    """Records the order of stores and loads by the first value of each stored buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[tuple[str, int]] = []

    def store(self, src: torch.Tensor) -> int:
        token = super().store(src)
        with self.lock:
            self.order.append(("store", token))
        return token

    def load(self, token: int, dst: torch.Tensor) -> None:
        super().load(token, dst)
        with self.lock:
            self.order.append(("load", token))


class _OpenGate(torch.autograd.Function):
    """Identity whose backward opens ``gate`` and waits until no store is in flight: runs
    between the backward nodes before and after it."""

    @staticmethod
    def forward(ctx, x, cache, gate):  # type: ignore[override]
        ctx.cache, ctx.gate = cache, gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.gate.set()
        ctx.cache.wait_for_stores(JOIN_S)
        return grad, None, None


class SavedTwice(nn.Module):
    """``h`` is saved by ``sin`` before the gate and by ``cos`` after it: backward unpacks it
    once while its store is held at the gate, and once after the store finished."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64)])
        self.cache: TensorCache | None = None
        self.gate = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        a = torch.cos(h)  # unpacked last in backward
        a = _OpenGate.apply(a, self.cache, self.gate)
        b = torch.sin(h)  # unpacked first in backward, while the store is held
        return (a * b).sum()


@pytest.mark.timing
def test_backward_wanting_a_running_store_reads_nothing() -> None:
    """Forwarding (Note [Transfer ordering]): a tensor whose store is running when backward
    wants it stays in memory once the store finishes: no read, residency counted."""
    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    model = SavedTwice()
    model.gate = offloader.gate
    cache = make_cache(model, offloader)
    model.cache = cache
    try:
        x = torch.randn(8, 64)
        loss = model(x)
        assert offloader.store_started.acquire(timeout=JOIN_S), "no store started"
        loss.backward()
        stats = cache.stats()
    finally:
        offloader.gate.set()
        cache.close()
    assert stats.num_offloaded > 0
    assert offloader.num_loads == 0 and stats.reloaded_bytes == 0 and stats.num_sync_loads == 0
    # Every saved byte stayed resident (the stored copy was never the only one).
    assert stats.peak_resident_bytes >= 8 * 64 * 4


@pytest.mark.timing
def test_graphs_dying_with_queued_stores_leak_no_budget() -> None:
    """Stores still queued when their graph dies are cancelled and give their bytes back to
    the in-flight budget: many such steps neither leak nor hang."""
    offloader = FakeOffloader()
    offloader.gate = threading.Event()  # the first store blocks: the rest stay queued
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, offloader, max_inflight_bytes=1 << 30)
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for step in range(20):
                model(models.vector_batch(step))  # graph dropped: queued stores cancelled
            done.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert done.wait(JOIN_S), "forward hung: the in-flight budget leaked"
        assert not errors, errors
        offloader.gate.set()
        cache.wait_for_stores(JOIN_S)
        view = probe(cache)
        assert view.counters["inflight_bytes"] == 0
        assert view.counters["resident_bytes"] == 0 and view.num_entries == 0
        stats = cache.stats(cumulative=True)
        assert stats.num_cancelled > 0 and stats.num_steps >= 19
    finally:
        offloader.gate.set()
        thread.join(JOIN_S)
        cache.close()


def test_budget_is_returned_when_cancelled_stores_die_under_a_tight_bound() -> None:
    """With a bound that fits one step's stores, a leak of cancelled bytes would make the
    next step's forward wait forever: it must not."""
    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    model = models.Stack(num_blocks=3)
    x = models.vector_batch(0)
    measure = make_cache(model, FakeOffloader())
    model(x).backward()
    per_step = measure.stats().offloaded_bytes + measure.stats().kept_bytes
    measure.close()
    # The store held at the gate occupies at most one step of the budget; a leak of the
    # cancelled bytes (about one step per dead graph) fills the rest within two steps.
    cache = make_cache(model, offloader, max_inflight_bytes=2 * per_step)
    finished = threading.Event()

    def run() -> None:
        for _ in range(10):
            model(x)
        finished.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        # One store is held at the gate; everything else queued is cancelled when each graph
        # dies, so the budget never fills.
        assert finished.wait(JOIN_S), "forward waited forever on a leaked in-flight budget"
    finally:
        offloader.gate.set()
        thread.join(JOIN_S)
        cache.close()


def test_loads_run_in_reverse_forward_order() -> None:
    offloader = RecordingOffloader()
    model = models.Stack(num_blocks=6)
    cache = make_cache(model, offloader, prefetch_modules=10, num_load_threads=1)
    try:
        loss = model(models.vector_batch(0))
        cache.wait_for_stores(JOIN_S)
        loss.backward()
    finally:
        cache.close()
    stores = [t for kind, t in offloader.order if kind == "store"]
    loads = [t for kind, t in offloader.order if kind == "load"]
    assert stores and loads
    # Tokens are handed out in store (= pack = forward) order; backward needs the last first.
    assert loads == sorted(loads, reverse=True), f"loads in order {loads}"


def test_kept_scopes_use_no_look_ahead() -> None:
    """With the last blocks kept and prefetch_modules=1, entering backward prefetches the first
    offloaded block before the kept ones: nothing is loaded synchronously."""
    offloader = FakeOffloader()
    model = models.Stack(num_blocks=6)
    cache = make_cache(model, offloader, prefetch_modules=1, keep_last_modules=2)
    try:
        for step in range(3):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(JOIN_S)
            loss.backward()
        stats = cache.stats(cumulative=True)
    finally:
        cache.close()
    assert stats.reloaded_bytes > 0
    assert stats.num_sync_loads == 0, f"{stats.num_sync_loads} loads were not prefetched"


@pytest.mark.timing
@pytest.mark.parametrize("offloading", ["none", "too small to offload", "offloads"])
def test_prefetch_hooks_only_where_something_is_offloaded(offloading: str) -> None:
    """Note [Prefetch hooks]: a forward that marked nothing for offload registers no grad_fn
    pre-hook, and its step still ends with its backward, with every entry dropped."""
    model = models.Stack(num_blocks=3)
    options = {"min_offload_bytes": 1 << 30} if offloading == "too small to offload" else {}
    if offloading == "none":
        cache = tba.configure_tensor_cache(model, offloader="none", offload_devices=("cpu",),
                                           min_offload_bytes=0, adaptive=False)
    else:
        cache = make_cache(model, FakeOffloader(), **options)
    view = probe(cache)
    try:
        for step in range(2):
            loss = model(models.vector_batch(step))
            hooks = view.num_grad_fn_hooks
            if offloading == "offloads":
                cache.wait_for_stores(JOIN_S)  # a busy machine must not cancel every store
            loss.backward()
            assert not view.step_open and view.num_entries == 0
            assert cache.stats().num_packed > 0
            if offloading == "offloads":
                assert hooks > 0 and cache.stats().num_offloaded > 0
            else:
                assert hooks == 0 and cache.stats().num_offloaded == 0
        assert cache.stats(cumulative=True).num_steps == 2
    finally:
        cache.close()


def test_close_removes_the_hooks_of_live_graphs() -> None:
    """A graph built with the cache and still alive at close() must not keep the cache (its
    grad_fn pre-hooks are removed) and fails its backward with a TBAError that says why."""
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, FakeOffloader(), keep_last_modules=0)
    loss = model(models.vector_batch(0))
    view = probe(cache)
    assert view.num_grad_fn_hooks, "the forward registered no grad_fn pre-hook"
    cache.close()
    assert view.num_grad_fn_hooks == 0 and view.num_module_hooks == 0
    ref = weakref.ref(cache)
    del cache, view
    gc.collect()
    assert ref() is None, "a live graph still references the closed cache"
    with pytest.raises(tba.TBAError, match="after its tensor cache was closed"):
        loss.backward()


def test_invariant_check_names_the_broken_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Cache invariants]: a counter that drifts from what the entries hold is reported
    after the step, in the training step, naming the invariant and the numbers."""
    from tba.cache.engine.core import Engine

    monkeypatch.setenv("TBA_CHECK_INVARIANTS", "1")
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, FakeOffloader())
    original = Engine._drop

    def leaky_drop(self, entry):
        original(self, entry)
        self.resident_bytes += 1  # a plausible accounting slip

    try:
        model(models.vector_batch(0)).backward()
        monkeypatch.setattr(Engine, "_drop", leaky_drop)
        with pytest.raises(tba.TBAError, match="invariant violated.*resident_bytes is"):
            model(models.vector_batch(1)).backward()
    finally:
        monkeypatch.undo()
        cache.close()


@pytest.mark.timing
def test_fetch_of_a_running_store_keeps_the_bytes_without_prefetch() -> None:
    """The engine alone: unpack (fetch) of an entry whose store is running, with no prefetch
    before it, keeps the bytes in memory once the store finishes: a second fetch reads
    nothing and the bytes stay counted as resident."""
    from tba.cache.engine import State

    offloader = FakeOffloader()
    offloader.gate = threading.Event()
    saved = torch.arange(1024, dtype=torch.float32)
    engine, handle = bare_engine(offloader, saved)
    entry = handle.entry
    storage = saved.untyped_storage()
    try:
        engine.flush()
        assert offloader.store_started.acquire(timeout=JOIN_S), "the store never started"
        assert entry.state is State.STORING
        data, _ = engine.fetch(entry)  # backward wants it while the store runs
        offloader.gate.set()
        engine.wait_for_stores(JOIN_S)
        assert entry.state is State.READY and entry.data is not None
        assert engine.resident_bytes == storage.nbytes()
        again, _ = engine.fetch(entry)
        assert again is data and offloader.num_loads == 0 and engine.step.num_sync_loads == 0
    finally:
        offloader.gate.set()
        del handle, entry
        engine.drain()
        engine.close()
    assert engine.resident_bytes == 0 and not engine.check()


class GatedLoads(FakeOffloader):
    """Each load blocks until ``load_gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.load_gate = threading.Event()

    def load(self, token, dst):
        assert self.load_gate.wait(JOIN_S), "test load gate never opened"
        super().load(token, dst)


@pytest.mark.timing
def test_a_reserve_asked_while_loads_are_queued_runs_when_they_are_done() -> None:
    """The store worker waits while loads are queued, a reserve included: when the load queue
    empties it must wake for the reserve even with no store queued, or ``wait_for_stores``
    waits for that reserve forever (seen as "0 bytes of stores still in flight")."""
    offloader = GatedLoads()
    first = torch.arange(1024, dtype=torch.float32)
    second = torch.arange(1024, dtype=torch.float32) * 2
    engine, handle = bare_engine(offloader, first)  # one load worker
    scope = handle.scope
    other = engine.save(second, second.untyped_storage(), second, scope, scope.record, True)
    entries = [handle.entry, other.entry]
    try:
        engine.flush()
        engine.wait_for_stores(JOIN_S)
        engine.prefetch(entries)  # the first load blocks on the gate, the second stays queued
        engine.reserve_later(4096)
        # The store worker wakes for the reserve, finds a load queued and waits again.
        # (CPython's Condition keeps its waiters in ``_waiters``: the only way to see that.)
        waiters = engine._store_ready._waiters
        assert wait_until(lambda: len(waiters) > 0, JOIN_S), "the store worker never waited"
        offloader.load_gate.set()
        engine.wait_for_stores(JOIN_S)  # with the bug: "0 bytes of stores still in flight"
        assert offloader.reserved == [4096]
        # The reserve may run as soon as the load worker has taken the second load, before
        # that load has finished (a busy machine showed num_loads == 1 here).
        engine.wait_idle(JOIN_S)
        assert offloader.num_loads == 2
    finally:
        offloader.load_gate.set()
        del handle, other, entries
        engine.drain()
        engine.close()
    assert not engine.check()


class GatedReserve(FakeOffloader):
    """``reserve`` blocks until ``reserve_gate`` is set; ``reserve_started`` is set on entry."""

    def __init__(self) -> None:
        super().__init__()
        self.reserve_gate = threading.Event()
        self.reserve_started = threading.Event()

    def reserve(self, num_bytes: int) -> None:
        self.reserve_started.set()
        assert self.reserve_gate.wait(JOIN_S), "test reserve gate never opened"
        super().reserve(num_bytes)


@pytest.mark.timing
def test_wait_for_stores_waits_for_a_running_reserve() -> None:
    """A reserve the store worker has taken and runs (the lock let go) still counts: the
    offloader is sized when ``wait_for_stores`` returns (a test's next step relies on it)."""
    offloader = GatedReserve()
    saved = torch.arange(1024, dtype=torch.float32)
    engine, handle = bare_engine(offloader, saved)
    try:
        engine.wait_for_stores(JOIN_S)
        engine.reserve_later(4096)
        assert offloader.reserve_started.wait(JOIN_S), "the reserve never started"
        with pytest.raises(tba.TBAError, match="still in flight"):
            engine.wait_for_stores(0.2)  # the gate is shut: the reserve cannot have finished
        offloader.reserve_gate.set()
        engine.wait_for_stores(JOIN_S)
        assert offloader.reserved == [4096]
    finally:
        offloader.reserve_gate.set()
        del handle
        engine.drain()
        engine.close()


def test_a_dead_worker_surfaces_in_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Dead workers]: an exception escaping a worker loop (a tba bug) is raised in the
    training step, and again in every later one, instead of leaving forward waiting forever."""
    import tba.cache.engine.workers as workers

    def broken(storage):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(workers, "storage_bytes", broken)
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, FakeOffloader(), max_inflight_bytes=1)  # forward waits on stores
    outcome: list[BaseException] = []

    def run() -> None:
        for step in range(2):
            try:
                model(models.vector_batch(step)).backward()
            except tba.TBAError as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    try:
        assert not thread.is_alive(), "training waited forever on a dead worker"
        assert len(outcome) == 2
        assert all("transfer worker tba-store-0 died" in str(e) and "planted bug" in str(e) for e in outcome)
    finally:
        monkeypatch.undo()
        cache.close()  # does not raise the dead worker again


@pytest.mark.timing
def test_a_failed_step_raises_one_store_error_not_stale_ones() -> None:
    """Note [One store error per step]: once a store error was raised in a step, the other
    stores of that step failing later are counted, not raised again in the next step or by
    close()."""

    class OneAtATime(FakeOffloader):
        def __init__(self) -> None:
            super().__init__()
            self.permits = threading.Semaphore(0)

        def store(self, src: torch.Tensor) -> int:
            assert self.permits.acquire(timeout=JOIN_S), "the test never let this store run"
            return super().store(src)

    offloader = OneAtATime()
    offloader.fail_store = True
    model = models.Stack(num_blocks=3)
    cache = make_cache(model, offloader)
    try:
        loss = model(models.vector_batch(0))
        offloader.permits.release()  # the first store fails ...
        with pytest.raises(tba.OffloadIOError, match="injected write failure"):
            cache.wait_for_stores(JOIN_S)  # ... and is raised in the step
        offloader.permits.release(1000)  # the step's other stores fail after that
        cache.wait_for_stores(JOIN_S)  # not raised again
        del loss  # the failed step ends
        offloader.fail_store = False
        model(models.vector_batch(1)).backward()  # no stale error in the next step
        total = cache.stats(cumulative=True)
    finally:
        offloader.permits.release(1000)
        cache.close()  # nor at close
    assert total.num_io_errors > 1


class _LoadOrder(FakeOffloader):
    """Records, at each load, the tokens of earlier loads not yet released."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[int] = []
        self.late: list[int] = []

    def load(self, token: int, dst: torch.Tensor) -> None:
        with self.lock:
            self.late += [t for t in self.loaded if t not in self.released]
            self.loaded.append(token)
        super().load(token, dst)


@pytest.mark.timing
def test_reloaded_entries_give_their_offloader_space_back_at_once() -> None:
    """Note [A reloaded entry holds no offloader space] (tba/cache/engine/workers.py): a load's
    token is released as soon as the bytes are back, while backward still holds the entry, so
    the offloader and memory never both hold them. With one load worker, every load starts
    after the tokens of the loads before it were given back; prefetch (2 modules ahead) loads
    entries well before backward is done with them. Mid-backward the reloaded entries hold no
    offloader space by the engine's own counters and the invariant check agrees; gradients
    are bit-exact."""
    mid_backward: list[tuple[list, dict, list[str]]] = []

    def run(offloader: FakeOffloader | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = models.Stack(num_blocks=6)
        cache = make_cache(model, offloader, prefetch_modules=2) if offloader is not None else None
        if cache is not None:
            look = probe(cache)

            def snapshot(grad: torch.Tensor) -> None:
                look.wait_idle(JOIN_S)  # the loads prefetched so far are done: their entries live on
                mid_backward.append((look.entries, look.counters, look.check_invariants()))

            def watch(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
                out.register_hook(snapshot)

            model.blocks[2].register_forward_hook(watch)
        for step in range(2):
            loss = model(models.vector_batch(step))
            if cache is not None:
                cache.wait_for_stores(60)  # every store done: backward reads them all back
            loss.backward()
        if cache is not None:
            assert cache.stats().reloaded_bytes > 0
            assert probe(cache).check_invariants() == []
            cache.close()
        return [p.grad for p in model.parameters()]

    offloader = _LoadOrder()
    grads = run(offloader)
    assert len(offloader.loaded) > 6 and offloader.late == []
    assert sorted(offloader.released) == sorted(offloader.loaded) and not offloader.blobs
    assert all(torch.equal(a, b) for a, b in zip(grads, run(None)))
    assert len(mid_backward) == 2
    for entries, counters, problems in mid_backward:
        assert problems == []
        states = {e.state for e in entries}
        assert "reloaded" in states, states
        in_offloader = sum(e.nbytes for e in entries if e.state in ("stored", "loading", "ready"))
        assert counters["held_bytes"] == in_offloader
