"""Handles freed by the garbage collector (Note [Interrupt-safe bookkeeping]): a handle's death
only queues its release (a weak reference's C-level callback), wherever the collector runs,
also inside tba's lock or an offloader's; the release is done at tba's next entry point. No
deadlock, nothing re-entered half-way, nothing leaked."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import tba
from tba.testing import probe
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


@pytest.mark.parametrize("where", ["engine", "offloader"])
def test_handles_collected_under_a_lock_are_released_later(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import tba.cache.engine.entries as entries

    model = models.Stack(num_blocks=3)
    reference = models.Stack(num_blocks=3)
    reference.load_state_dict(model.state_dict())
    from tba.cache.engine.core import Engine

    collected: list[int] = []
    armed: list = []  # holds the cache's probe once the cycle exists
    queued_inside: list[int] = []
    # The releases other threads drained while the collecting thread was in collect_once (the
    # training thread may drain at any entry point while a store thread collects in the host
    # pool's lock), and whether the collecting thread drained any there itself.
    window: dict[str, object] = {"thread": None, "by_others": 0, "by_itself": False}
    real_drain = Engine._drain_locked

    def drain(self) -> None:
        if window["thread"] is not None:
            if window["thread"] == threading.get_ident():
                window["by_itself"] = True
            else:
                window["by_others"] = int(window["by_others"]) + len(self.released)  # type: ignore[call-overload]
        real_drain(self)

    monkeypatch.setattr(Engine, "_drain_locked", drain)

    def collect_once() -> None:
        if armed and not collected:
            window["thread"] = threading.get_ident()
            try:
                collected.append(gc.collect())
                # Still inside the lock: the collected handles' releases are queued, not run
                # here (re-entering the engine in the middle of a critical section).
                queued_inside.append(armed[0].num_released_pending + int(window["by_others"]))  # type: ignore[call-overload]
            finally:
                window["thread"] = None

    if where == "offloader":  # inside the host pool's lock (taking an extent for a store)
        from tba.offloaders.host import HostOffloader

        real_take = HostOffloader._take

        def take(self, pinned, num_bytes):
            collect_once()
            return real_take(self, pinned, num_bytes)

        monkeypatch.setattr(HostOffloader, "_take", take)
    else:  # the collector runs inside the engine's lock (a new entry is made)
        real_entry = entries.Entry

        class CollectingEntry(real_entry):  # type: ignore[misc, valid-type]
            __slots__ = ()

            def __init__(self, *args, **kwargs) -> None:
                collect_once()
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(entries, "Entry", CollectingEntry)  # what new_entry makes

    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        view = probe(cache)
        gc.disable()  # the collection happens exactly where the test puts it
        try:
            _cycle_holding_a_graph(model)
            armed.append(view)  # the next entry (or host-pool extent) runs the collector

            def step() -> None:
                torch.manual_seed(0)
                model(models.vector_batch(0)).backward()

            _run_bounded(step)
        finally:
            gc.enable()
        assert collected and collected[0] > 0, "the planted collection found no cycle"
        assert queued_inside and queued_inside[0] > 0, "releases ran inside the lock"
        assert not window["by_itself"], "the collecting thread drained releases inside the lock"
        assert view.num_entries == 0  # every queued release was done, the cycle's entries too
        assert view.num_released_pending == 0
        assert not view.check_invariants()
    torch.manual_seed(0)
    reference(models.vector_batch(0)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("call", ["stats", "summary", "wait_for_stores"])
def test_a_graph_the_collector_freed_is_released_at_the_next_public_call(call: str) -> None:
    """The releases the collector queued are done by the cache's next public call, not only
    by a later forward: the step the dead graph belonged to is counted then."""
    model = models.Stack(num_blocks=3)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=False) as cache:
        torch.manual_seed(0)
        model(models.vector_batch(0)).backward()
        packed_per_step = cache.stats().num_packed
        assert packed_per_step > 0
        view = probe(cache)
        gc.disable()  # the collection happens exactly where the test puts it
        try:
            _cycle_holding_a_graph(model)  # a forward whose graph only a cycle holds
            assert gc.collect() > 0
        finally:
            gc.enable()
        assert view.num_released_pending > 0, "the collector's releases were not queued"
        getattr(cache, call)()
        assert view.num_released_pending == 0 and view.num_entries == 0
        total = cache.stats(cumulative=True)
        assert total.num_packed == 2 * packed_per_step and total.num_steps == 2
