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
