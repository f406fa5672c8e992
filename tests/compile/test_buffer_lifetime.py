"""Note [Stored buffers are not reused] (tba/compile/lowering.py), under Inductor: every store is
held in flight until the forward graph has returned (an offloader that waits for the test to open
a gate), so every byte a store copies is read after everything the graph did after the store.
As compiled (Inductor's buffer reuse and in-place buffers on; the buffers the stores take kept
out of reuse) the stores copy the bytes the graph stored (bit-exact training); with the store
lowered as a plain fallback kernel, Inductor hands stored buffers to later values while their
stores wait (wrong gradients), the planted bug any lifetime model for stored buffers must rule
out."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from torch._inductor import lowering as inductor_lowering

import tba
from tba.compile import lowering, ops
from tba.offloaders.host import HostOffloader
from tba.offloaders.wrapper import OffloaderWrapper
from tests.compile.training import Run, assert_same_training, train

GATE_TIMEOUT_S = 60.0  # bounded: a gate nobody opens fails the store, which fails the step


class _Gate(OffloaderWrapper):
    """A host offloader whose stores wait until :attr:`opened` is set."""

    passes_store_now = False  # every store on the store worker, through ``store``

    def __init__(self) -> None:
        super().__init__(HostOffloader(), "gated")
        self.opened = threading.Event()
        self.num_stored = 0

    def store(self, src: torch.Tensor) -> Any:
        if not self.opened.wait(GATE_TIMEOUT_S):
            raise RuntimeError(f"test gate: not opened within {GATE_TIMEOUT_S:g} s")
        self.num_stored += 1
        return self.inner.store(src)


def _held_run() -> tuple[Run, _Gate]:
    gate = _Gate()

    def after_forward(cache: tba.TensorCache | None) -> None:
        assert cache is not None
        assert gate.num_stored == 0, "a store passed the closed gate"
        gate.opened.set()  # the forward graph has returned: let the stores copy
        cache.wait_for_stores(GATE_TIMEOUT_S)
        gate.opened.clear()
        gate.num_stored = 0

    # Every block offloaded, no store refused for room, none inline: all wait at the gate.
    options = dict(offloader=gate, keep_last_modules=0, max_inflight_bytes=1 << 40)
    run = train("fused_attention", "inductor", options, steps=2, settle=False,
                after_forward=after_forward)
    return run, gate


def _offloaded_and_reloaded(run: Run) -> None:
    assert run.stats is not None
    assert run.stats.offloaded_bytes > 0 and run.stats.reloaded_bytes > 0, run.stats


def test_stores_held_until_the_graph_returned_copy_the_stored_bytes() -> None:
    reference = train("fused_attention", "inductor", None, steps=2)
    run, _ = _held_run()
    _offloaded_and_reloaded(run)
    assert_same_training(reference, run)


@pytest.mark.parametrize("invariants", [True, False])
def test_a_store_left_to_buffer_reuse_lets_inductor_overwrite_a_buffer_in_flight(
        monkeypatch: pytest.MonkeyPatch, invariants: bool) -> None:
    """The planted bug: ``tba::store`` lowered as Inductor's plain fallback kernel, its buffers
    left to Inductor's reuse (a stored buffer's lifetime ends at its store op). With
    TBA_CHECK_INVARIANTS=1 the run-time check sees a reused storage stored again; without it
    the store copies the later value's bytes and training goes wrong."""
    lowering.install()
    monkeypatch.setitem(inductor_lowering.lowerings, ops.STORE,
                        inductor_lowering.fallback_handler(ops.STORE))
    if invariants:  # the storage is stored again whether or not the first store completed
        monkeypatch.setenv("TBA_CHECK_INVARIANTS", "1")
        with pytest.raises(tba.TBAError, match="an alias stored twice"):
            train("fused_attention", "inductor", dict(offloader="host", keep_last_modules=0), steps=1)
        return
    monkeypatch.setenv("TBA_CHECK_INVARIANTS", "0")
    reference = train("fused_attention", "inductor", None, steps=2)
    run, _ = _held_run()
    _offloaded_and_reloaded(run)
    with pytest.raises(AssertionError, match="loss|grad"):
        assert_same_training(reference, run)
