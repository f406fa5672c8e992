"""Under ``torch.compile(model, backend="tba")`` the storages a compiled graph stores are freed
before its backward, told from outside the cache: finalizers on the storages
(``tba.testing.StorageWatch``), not the cache's own count."""

from __future__ import annotations

from pathlib import Path

import pytest

import tba
from tba.testing import StorageWatch, probe
from tests.compile.training import assert_offloaded_in_one_graph, assert_same_training, train

STEPS = 2


class _AfterForward:
    """Which watched storages are alive after each forward (the stores completed), then
    forgets them for the next step."""

    def __init__(self, watch: StorageWatch) -> None:
        self.watch = watch
        self.counts: list[tuple[int, int]] = []  # (alive, watched)
        self.resident_bytes: list[int] = []  # the cache's own count at the same moment

    def __call__(self, cache: tba.TensorCache | None) -> None:
        if cache is not None:
            self.resident_bytes.append(probe(cache).counters["resident_bytes"])
        self.counts.append((self.watch.num_alive, self.watch.num_watched))
        self.watch.clear()


@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_stored_storages_are_freed_before_backward(offloader: str, tmp_path: Path) -> None:
    # Compiled without tba: every storage the graph saves lives until backward.
    keep_watch = StorageWatch()
    keep = _AfterForward(keep_watch)
    with keep_watch.saved_tensors():
        reference = train("fused_attention", "aot_eager", None, steps=STEPS, after_forward=keep)
    assert len(keep.counts) == STEPS and all(alive == watched > 0 for alive, watched in keep.counts), keep.counts

    # Every block offloaded: a compiled graph stores its kept tail too, and the cache keeps
    # those entries (their storages rightly stay alive); with no tail every stored one dies.
    options = dict(offloader=offloader, keep_last_modules=0)
    if offloader == "ssd":
        options.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    watch = StorageWatch()
    after = _AfterForward(watch)
    with tba.compile.watch(watch.observe):
        run = train("fused_attention", "aot_eager", options, steps=STEPS, after_forward=after)
    assert_same_training(reference, run)
    assert_offloaded_in_one_graph(run)
    # Every storage the graph stored is freed once its store completed, before backward.
    assert len(after.counts) == STEPS and all(watched > 0 for _, watched in after.counts), after.counts
    assert [alive for alive, _ in after.counts] == [0] * STEPS, (
        f"(alive, stored) storages after forward, per step: {after.counts}; the cache's own count of "
        f"resident bytes then: {after.resident_bytes}")


class _OlderStoresAlive:
    """At each new storage a compiled graph stores, the watched storages alive other than the
    one stored just before (whose store may still run): with ``max_inflight_bytes=1`` a store
    waits for room until the previous store completed, so every older one must be freed by
    then, while the forward graph still runs (Note [Stored buffers live to the end of the
    graph] in tba/compile/runtime.py)."""

    def __init__(self) -> None:
        self.watch = StorageWatch()
        self.last: str | None = None
        self.older_alive: list[list[str]] = []
        self.num_stores = 0

    def observe(self, tensor: object, kind: str) -> None:
        if kind != "saved":
            return
        alive = [name for name in self.watch.alive if name != self.last]
        name = f"stored {self.num_stores}"
        if self.watch.watch(tensor, name):  # type: ignore[arg-type]
            self.older_alive.append(alive)
            self.last = name
            self.num_stores += 1

    def after_forward(self, cache: tba.TensorCache | None) -> None:
        self.watch.clear()
        self.last = None


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_stored_storages_are_freed_while_the_forward_graph_runs(inner: str) -> None:
    """A multi-block model in one graph: each stored storage is freed once its store completed,
    before the graph returns, though the graph holds the stored buffers to its end."""
    reference = train("fused_attention", inner, None, steps=STEPS)
    seen = _OlderStoresAlive()
    with tba.compile.watch(seen.observe):
        run = train("fused_attention", inner, dict(offloader="host", keep_last_modules=0,
                                                   max_inflight_bytes=1),
                    steps=STEPS, after_forward=seen.after_forward)
    assert_same_training(reference, run)
    assert_offloaded_in_one_graph(run)
    assert seen.num_stores >= 8 * STEPS, seen.num_stores
    assert all(not alive for alive in seen.older_alive), seen.older_alive
