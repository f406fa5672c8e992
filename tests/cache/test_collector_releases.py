"""Note [Releases from the collector]: handles freed by the garbage collector while this thread
holds the table's, the engine's or an offloader's lock are released later, never deadlock the
thread."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import tba
from tests import models

JOIN_S = 60.0


def _cycle_holding_a_graph(model) -> None:
    """A forward whose graph (hence its handles) only a reference cycle keeps alive."""
    loss = model(models.vector_batch(7))
    cycle: list = [loss]
    cycle.append(cycle)


def _run_bounded(fn) -> None:
    """``fn`` on a thread; a deadlock fails the test instead of hanging the suite."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the training thread deadlocked on a release from the collector"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("where", ["table", "engine", "offloader"])
def test_handles_collected_under_a_cache_lock_are_released_later(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import tba.cache.table as table_module
    import tba.cache.transfers as transfers_module

    model = models.Stack(num_blocks=3)
    reference = models.Stack(num_blocks=3)
    reference.load_state_dict(model.state_dict())
    collected: list[int] = []
    armed: list = []  # holds the cache's table once the cycle exists
    deferred_inside: list[int] = []

    def collect_once() -> None:
        if armed and not collected:
            collected.append(gc.collect())
            # Still inside the lock: the collected handles' releases must be queued, not run
            # here (re-entering the table or the engine in the middle of a critical section).
            deferred_inside.append(len(armed[0]._deferred))

    if where == "table":  # the collector runs while a new entry is made, table lock held
        real_entry = table_module.Entry

        class CollectingEntry(real_entry):  # type: ignore[misc, valid-type]
            __slots__ = ()

            def __init__(self, *args, **kwargs) -> None:
                collect_once()
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(table_module, "Entry", CollectingEntry)
    elif where == "offloader":  # inside the host pool's lock (taking an extent for a store)
        from tba.offloaders.host import HostOffloader

        real_take = HostOffloader._take

        def take(self, pinned, num_bytes):
            collect_once()
            return real_take(self, pinned, num_bytes)

        monkeypatch.setattr(HostOffloader, "_take", take)
    else:  # the collector runs inside the engine's lock (a new entry's accounting)
        real_note = transfers_module.Transfers._note_peak

        def collecting_note(self) -> None:
            collect_once()
            real_note(self)

        monkeypatch.setattr(transfers_module.Transfers, "_note_peak", collecting_note)
        real_add = transfers_module.Transfers.add

        def add(self, entry) -> None:
            with self.lock:  # the engine lock held, as in every critical section
                collect_once()
            real_add(self, entry)

        monkeypatch.setattr(transfers_module.Transfers, "add", add)

    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        gc.disable()  # the collection happens exactly where the test puts it
        try:
            _cycle_holding_a_graph(model)
            armed.append(cache._table)  # the next entry (or engine section) runs the collector

            def step() -> None:
                torch.manual_seed(0)
                model(models.vector_batch(0)).backward()

            _run_bounded(step)
        finally:
            gc.enable()
        assert collected and collected[0] > 0, "the planted collection found no cycle"
        assert deferred_inside and deferred_inside[0] > 0, "releases ran inside the lock"
        assert not cache._table._deferred  # every deferred release was done ...
        assert cache._table.num_entries == 0  # ... the cycle's entries too
        assert not cache._engine.check([])
    torch.manual_seed(0)
    reference(models.vector_batch(0)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("call", ["stats", "summary", "wait_for_stores"])
def test_a_step_the_collector_ended_is_counted_at_the_next_public_call(call: str) -> None:
    """Note [Releases from the collector]: the releases the collector queued are done by the
    cache's next public call, not only by a later forward: the step they end is counted."""
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        torch.manual_seed(0)
        model(models.vector_batch(0)).backward()
        packed_per_step = cache.stats().num_packed
        assert packed_per_step > 0
        gc.disable()  # the collection happens exactly where the test puts it
        try:
            _cycle_holding_a_graph(model)  # a forward whose graph only a cycle holds
            assert gc.collect() > 0
        finally:
            gc.enable()
        assert cache._table._deferred, "the collector's releases were not queued"
        getattr(cache, call)()
        assert not cache._table._deferred and cache._table.num_entries == 0
        assert cache.stats(cumulative=True).num_packed == 2 * packed_per_step
