"""The step tracker alone, fed events by hand (Note [Step boundaries]): where steps end for each
rule, pipeline hints, re-attached backwards, interrupted backwards, and the prefetch walk."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tba import _torch_compat as compat
from tba.cache.policy.boundary import Boundary
from tba.cache.steps.scopes import Unit
from tba.cache.steps.stages import StageHint
from tba.cache.steps.tracker import StepTracker
from torch import nn


class Harness:
    """A tracker with fake backward passes: ``backward(record, task)`` enters it as autograd
    would; ``end(task)`` runs that pass's end-of-backward callback."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, num_blocks: int = 4, keep: int = 1,
                 prefetch_modules: int = 2) -> None:
        self.task = -1
        self.callbacks: dict[int, list[Any]] = {}
        monkeypatch.setattr(compat, "graph_task_id", lambda: self.task)
        monkeypatch.setattr(compat, "queue_end_of_backward",
                            lambda fn: self.callbacks.setdefault(self.task, []).append(fn))
        self.steps_ended = 0
        self.steps_interrupted = 0  # of them, with every forward interrupted
        self.prefetched: list[list[Any]] = []
        self.boundary = Boundary(num_blocks, keep)
        self.tracker = StepTracker(
            threading.RLock(), lambda: None, lambda: None, self.boundary, prefetch_modules,
            self.prefetched.append, self._ended,
        )
        self.modules = [nn.Linear(1, 1) for _ in range(num_blocks)]
        self.units = [Unit(m, f"blocks.{i}", i) for i, m in enumerate(self.modules)]

    def _ended(self, interrupted: bool) -> None:
        self.steps_ended += 1
        self.steps_interrupted += interrupted

    def forward(self, num_handles: int = 1, entries_per_block: int = 1) -> Any:
        """One forward through every block, each saving ``entries_per_block`` (fake) entries."""
        tracker = self.tracker
        record, _ = tracker.begin_forward()
        forward = tracker.local.forward
        for unit in self.units:
            forward.enter(unit, self.boundary.tail_start)
            scope = forward.scope()
            scope.entries.extend(f"{unit.name}/{k}" for k in range(entries_per_block))
            forward.exit()
        record.num_handles = num_handles
        tracker.end_forward(tracker.local)
        return record

    def backward(self, record: Any, task: int) -> None:
        self.task = task
        self.tracker.backward_entered(record.scopes[-1])
        self.task = -1

    def end(self, task: int) -> None:
        for callback in self.callbacks.pop(task):
            self.task = task
            callback()
        self.task = -1


def test_forward_then_backward_is_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    record = h.forward()
    assert h.tracker.open and h.steps_ended == 0
    h.backward(record, task=7)
    assert h.steps_ended == 0  # the pass is still running
    h.end(7)
    assert h.steps_ended == 1 and not h.tracker.open and not h.tracker.records


def test_forwards_then_one_backward_over_both_is_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    a, b = h.forward(), h.forward()
    h.backward(b, task=1)
    h.tracker.records_dead([b])  # b's handles all released before backward reached a
    h.backward(a, task=1)
    assert h.steps_ended == 0
    h.end(1)
    assert h.steps_ended == 1 and not h.tracker.open


def test_a_newer_unbackwarded_forward_keeps_the_step_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """F0 F1 B0 (1F1B by hand): F1's backward is still to come."""
    h = Harness(monkeypatch)
    a, b = h.forward(), h.forward()
    h.backward(a, task=1)
    h.end(1)
    assert h.steps_ended == 0 and h.tracker.open
    h.backward(b, task=2)
    h.end(2)
    assert h.steps_ended == 1


def test_an_older_kept_preview_is_superseded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule (c): a forward-only graph kept alive does not hold the step open, also when the
    backwarded record died (its handles released) before the pass ended."""
    h = Harness(monkeypatch)
    preview = h.forward()
    record = h.forward()
    h.backward(record, task=3)
    h.tracker.records_dead([record])  # backward released everything it saved ...
    assert h.steps_ended == 0 and h.tracker.open
    h.end(3)  # ... and the pass ended
    assert h.steps_ended == 1 and preview.detached and not h.tracker.records


def test_a_dead_graph_without_backward_ends_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule (b): an evaluation forward under grad whose output is dropped."""
    h = Harness(monkeypatch)
    record = h.forward()
    h.tracker.records_dead([record])
    assert h.steps_ended == 1
    h.forward(num_handles=0)  # saved nothing tba manages: over when it ends
    assert h.steps_ended == 2


def test_pipeline_hints_hold_the_step_until_the_last_action(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    tracker = h.tracker
    tracker.set_stage(StageHint(0, 0, "forward", None, 1, "forward"))
    a = h.forward()
    tracker.set_stage(StageHint(0, 1, "forward", None, 1, "backward"))
    b = h.forward()
    tracker.set_stage(StageHint(0, 1, "backward", None, 0, "backward"))
    h.backward(b, task=1)
    h.end(1)
    assert h.steps_ended == 0
    tracker.set_stage(StageHint(0, 0, "backward"))
    h.backward(a, task=2)
    h.end(2)
    assert h.steps_ended == 1


def test_a_second_backward_of_a_retained_graph_is_a_step_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    record = h.forward()
    h.backward(record, task=1)
    h.end(1)
    assert h.steps_ended == 1 and record.detached
    h.backward(record, task=2)  # retain_graph=True, backward again
    assert h.tracker.open and not record.detached
    h.end(2)
    assert h.steps_ended == 2


def test_an_interrupted_backward_ends_its_step_at_the_next_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    record = h.forward()
    h.backward(record, task=1)
    h.callbacks.pop(1)  # the pass raised: autograd never runs its callbacks
    assert h.steps_ended == 0
    h.forward()
    assert h.steps_ended == 1 and h.tracker.open


def _interrupted_forward(h: Harness, num_handles: int) -> Any:
    """A forward that an interrupt ends in its first block, closed as the next forward or save
    closes it (Note [Interrupted forwards]); ``num_handles`` of its saves are still alive."""
    tracker = h.tracker
    record, _ = tracker.begin_forward()
    tracker.local.forward.enter(h.units[0], h.boundary.tail_start)
    tracker.local.forward.scope().entries.append("blocks.0/0")
    record.num_handles = num_handles
    tracker.abandon_forward(tracker.local)
    return record


def test_a_step_of_interrupted_forwards_only_is_no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: what an interrupted forward left was a step of its own (counted, judged by
    the offloaded-nothing warning). The tracker says it was interrupted; the steps drop it."""
    h = Harness(monkeypatch)
    abandoned: list[bool] = []
    h.tracker.on_forward_abandoned = lambda: abandoned.append(True)
    record = h.forward()
    h.backward(record, task=1)
    h.end(1)
    assert (h.steps_ended, h.steps_interrupted) == (1, 0)
    _interrupted_forward(h, num_handles=0)  # its saves died with the interrupt
    assert (h.steps_ended, h.steps_interrupted) == (2, 1) and abandoned == [True]
    record = h.forward()
    h.backward(record, task=2)
    h.end(2)
    assert (h.steps_ended, h.steps_interrupted) == (3, 1)


def test_an_interrupted_forward_kept_alive_joins_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traceback keeps the interrupted forward's saves alive: the forward after it runs in
    the same step, which is a step (of one forward: the tracker counts the interrupted one
    apart)."""
    h = Harness(monkeypatch)
    interrupted = _interrupted_forward(h, num_handles=1)
    assert h.steps_ended == 0 and h.tracker.open
    record = h.forward()
    assert h.tracker.num_forwards - h.tracker.num_abandoned == 1
    h.backward(record, task=1)
    h.end(1)  # rule (c): the interrupted forward was never backwarded, a later one was
    assert (h.steps_ended, h.steps_interrupted) == (1, 0) and interrupted.detached
    assert h.tracker.num_abandoned == 0


def test_prefetch_walks_past_kept_scopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entering backward at the kept tail loads the tail's tensors and the first
    ``prefetch_modules`` offloaded blocks before it, last saved first; no further."""
    h = Harness(monkeypatch, num_blocks=6, keep=2, prefetch_modules=1)
    record = h.forward(entries_per_block=2)
    assert [s.keep for s in record.scopes] == [False] * 4 + [True] * 2
    h.backward(record, task=1)
    (wanted,) = h.prefetched
    # blocks.4 is kept (in memory: nothing to load) and uses none of the look-ahead.
    assert wanted == ["blocks.5/1", "blocks.5/0", "blocks.3/1", "blocks.3/0"]
