"""`StepTracker`: the forward passes (records) of the running step, where steps end, and the
prefetch walk of backward. Fed by events (forward begin/end, unit exit, backward entered and
ended, graphs gone, stage hints); testable without a model.

Note [Step boundaries]: a step is one or more forwards of the model and the backward passes of
their graphs. Each forward is a *record*. A record is finished when
  (a) a backward pass that used it has ended (autograd's end-of-backward callback, queued the
      first time backward reaches the record in that pass), or
  (b) its graph is gone: its forward ended and every handle it saved was released (a forward
      under grad whose output was dropped, or one that saved nothing tba manages), or
  (c) it was never backwarded and a later record of the step was (a kept "preview" output, an
      evaluation forward with grad enabled: such graphs do not hold the step open).
The step ends when no forward of the model is running and every record of it is finished; with
pipeline hints, only once the scheduler announced no next action. So: forward then backward is
one step; several forwards then one backward over all of them (gradient accumulation with a
summed loss) are one step; forward, backward, forward, backward (accumulation one microbatch at
a time) are two; forwards whose graphs are kept and never backwarded stay in the step of the
next backward. A backward whose graph's step already ended (``retain_graph=True`` run again;
backwards in the reverse order of their forwards without pipeline hints) is a step of its own.
A backward that never ends (interrupted) is taken as ended at the next forward when every
record of the step had started its backward. A forward that an interrupt or an exception
ended (Note [Interrupted forwards]) is no forward of its step: what it saved stays in the step, but a step
whose every forward was interrupted is no step (its counters join the totals only, it is not
profiled, numbered or judged). Records of an ended step are dropped with their
grad_fn hooks, so what the tracker holds is bounded by the running step.

All methods run under the engine's lock (one lock: Note [One owner of entry life]).

Note [Prefetch hooks]: backward enters a scope at the first unpack of a tensor saved in it,
and earlier when it reaches the grad_fn of the unit's output (a pre-hook registered when the
unit returns): that earlier entry is what starts loads ahead of the unpacks (``prefetch_from``).
A unit that returns before anything of its record was marked for offload, or of a cache
without an offloader, gets no pre-hook: ``prefetch_from`` there could only look at scopes
whose entries all stay in memory (scopes get entries only while their unit runs, and an entry
is marked for offload when it is made). Registering a pre-hook costs more than the unit's
saves on a small model, and each one runs again in backward. Entering at the first unpack does
the rest the pre-hook did (a backward of a detached record attaches it; the end of the
backward pass is heard). Tested in tests/cache/test_engine.py
(test_prefetch_hooks_only_where_something_is_offloaded).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tba import _torch_compat as compat
from tba.cache.engine import interrupts
from tba.cache.policy.boundary import Boundary
from tba.cache.steps.forward_state import ThreadState
from tba.cache.steps.scopes import Record, Scope
from tba.cache.steps.stages import StageHint
from tba.cache.steps.steps import tensors_in

if TYPE_CHECKING:
    from tba.cache.engine.entries import Entry

__all__ = ["StepTracker"]

logger = logging.getLogger(__name__)


class StepTracker:
    """Records of the running step, step boundaries and the prefetch walk.

    Args:
        lock: the engine's lock (taken by the hooks autograd calls: grad_fn pre-hooks and the
            end-of-backward callback).
        drain: does the engine's queued releases (lock held).
        raise_pending: raises the engine's pending error on the training thread.
        boundary: which blocks are kept (the tail) for the forwards that begin now.
        prefetch_modules: offloaded scopes loaded ahead when backward enters a scope.
        prefetch: starts loading a list of entries (the engine's ``prefetch``); None without
            an offloader.
        on_step_end: called (lock held) when a step ends, with whether every forward of it was
            interrupted (then it is no step: Note [Step boundaries]).
    """

    def __init__(
        self,
        lock: threading.RLock,
        drain: Callable[[], None],
        raise_pending: Callable[[], None],
        boundary: Boundary,
        prefetch_modules: int,
        prefetch: Callable[[list[Entry]], None] | None,
        on_step_end: Callable[[bool], None],
    ) -> None:
        self.lock = lock
        self._drain = drain
        self._raise_pending = raise_pending
        self.boundary = boundary
        self._prefetch_modules = prefetch_modules
        self._prefetch = prefetch
        self._on_step_end = on_step_end
        self.local = ThreadState()
        # By record key (stage, microbatch); a detached record's backward by ("bwd", seq).
        self.records: dict[tuple[int, int] | tuple[str, int], Record] = {}
        self.open = False
        self.num_active = 0  # forwards running, all threads
        self.num_forwards = 0  # forwards in the running step
        self.num_abandoned = 0  # of them, ended by an interrupt (Note [Interrupted forwards])
        self.hint: StageHint | None = None
        self._seq = itertools.count()
        self._auto_keys = itertools.count()
        # Backward passes under way whose end callback is queued: task -> the latest forward
        # (record seq) they reached; at their end that becomes ``_done_seq`` (rule (c)).
        self._queued_tasks: dict[int, int] = {}
        self._done_seq = -1
        self.on_forward_abandoned: Callable[[], None] | None = None  # the steps' (profile, count)
        self.closed = False

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> tuple[Record, bool]:
        """A forward of the model starts on this thread (the outermost call). Returns its
        record and whether it opened a step."""
        if self.open and not self.num_active and all(
            r.backward_started or self._superseded(r) for r in self.records.values()
        ):
            # Note [Step boundaries]: a backward that never ended (interrupted).
            self.end_step()
        hint = self.hint
        if hint is not None and hint.action == "forward":
            key, keep_tail = hint.record_key, hint.keeps_tail
        else:
            key, keep_tail = (-1, next(self._auto_keys)), True
        old = self.records.get(key)
        if old is not None:
            self._detach(old)
        record = self.records[key] = Record(key, keep_tail, next(self._seq))
        opened, self.open = not self.open, True
        self.num_active += 1
        self.num_forwards += 1
        self.local.forward.begin(record)
        return record, opened

    def end_forward(self, state: ThreadState) -> None:
        """This thread's outermost forward ended (or was abandoned: Note [Interrupted
        forwards])."""
        record = state.forward.record
        state.forward.end()
        self.num_active = max(0, self.num_active - 1)
        if record is not None:
            record.forward_done = True
            if not record.num_handles:
                self.records_dead([record])
                return
        self.maybe_end_step()

    def abandon_forward(self, state: ThreadState) -> None:
        """Close this thread's forward that an interrupt or an exception ended (Note
        [Interrupted forwards])."""
        logger.info("tba: a forward on this thread was interrupted or raised; closing it")
        state.leave_hooks()
        self.num_abandoned += 1
        if self.on_forward_abandoned is not None:
            self.on_forward_abandoned()
        self.end_forward(state)

    def unit_exited(self, scope: Scope, output: Any) -> None:
        """A unit's forward saved into ``scope`` and returned ``output``: backward reaching
        ``output``'s grad_fn enters the scope (a pre-hook, removed when the step ends), when a
        prefetch from there could load anything (Note [Prefetch hooks])."""
        record = scope.record
        if record.detached or not record.offloads or self._prefetch is None:
            return
        seen: set[int] = set()
        for tensor in tensors_in(output):
            fn = tensor.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                record.grad_fn_hooks.append(
                    fn.register_prehook(functools.partial(self._grad_fn_entered, scope))
                )

    def _grad_fn_entered(self, scope: Scope, *unused: Any) -> None:
        """A grad_fn pre-hook: backward reached a unit's output."""
        if self.closed or (scope.backward_entered and not scope.record.detached):
            return
        with self.lock:
            self.backward_entered(scope)
        if interrupts.pending:
            interrupts.raise_pending()

    # ------------------------------------------------------------------ backward
    def backward_entered(self, scope: Scope) -> None:
        """Backward reached ``scope`` (a grad_fn pre-hook, or an unpack): prefetch, and make
        sure the end of this backward pass is heard."""
        record = scope.record
        if record.detached:
            self._attach(record)
        scope.backward_entered = True
        record.backward_started = True
        task = compat.graph_task_id()
        if task != -1:
            record.backward_task = task
            if task not in self._queued_tasks:
                self._queued_tasks[task] = record.seq
                compat.queue_end_of_backward(functools.partial(self._backward_ended_hook, task))
            else:
                self._queued_tasks[task] = max(self._queued_tasks[task], record.seq)
        self.prefetch_from(scope)

    def _backward_ended_hook(self, task: int) -> None:
        """Autograd's end-of-backward callback: releases of the pass, then step end."""
        if self.closed:
            return
        with self.lock:
            self._drain()
            self.backward_ended(task)
        if interrupts.pending:
            interrupts.raise_pending()
        self._raise_pending()  # an I/O error or violation found at the step's end

    def backward_ended(self, task: int) -> None:
        """The backward pass ``task`` ended: its records are done."""
        self._done_seq = max(self._done_seq, self._queued_tasks.pop(task, -1))
        for record in self.records.values():
            if record.backward_started and record.backward_task == task:
                record.backward_done = True
        self.maybe_end_step()

    def _attach(self, record: Record) -> None:
        """A backward of a record whose step ended: it belongs to the running step, or opens
        one of its own (Note [Step boundaries])."""
        record.detached = False
        record.backward_done = False
        for scope in record.scopes:
            scope.backward_entered = False
        self.records[("bwd", record.seq)] = record
        self.open = True

    def records_dead(self, records: list[Record]) -> None:
        """Every handle of these records was released after their forward ended."""
        for record in records:
            for key in (record.key, ("bwd", record.seq)):
                if self.records.get(key) is record:
                    del self.records[key]
            self._detach(record)
        self.maybe_end_step()

    # ------------------------------------------------------------------ step end
    def _superseded(self, record: Record) -> bool:
        """Never backwarded, and a backward pass over a later record of the step ended: a
        forward-only graph. Not for pipeline records (their backwards run in any order)."""
        return (
            record.forward_done and not record.backward_started and record.seq < self._done_seq
            and record.key[0] == -1
        )

    def maybe_end_step(self) -> None:
        """End the step if nothing of it is pending (Note [Step boundaries]): no forward and
        no backward pass running, every record finished."""
        if not self.open or self.num_active or self._queued_tasks or self.closed:
            return
        hint = self.hint
        if hint is not None and hint.next_action is not None:
            return
        for record in self.records.values():
            if not (record.backward_done or self._superseded(record)):
                return
        self.end_step()

    def end_step(self) -> None:
        for record in self.records.values():
            self._detach(record)
        self.records.clear()
        self._queued_tasks.clear()
        self._done_seq = -1
        interrupted = 0 < self.num_abandoned == self.num_forwards
        self.open = False
        self.num_forwards = self.num_abandoned = 0
        self._on_step_end(interrupted)

    def _detach(self, record: Record) -> None:
        record.detached = True
        hooks, record.grad_fn_hooks = record.grad_fn_hooks, []
        for hook in hooks:  # graphs still alive signal backward at their first unpack
            hook.remove()

    # ------------------------------------------------------------------ prefetch and hints
    def prefetch_from(self, scope: Scope) -> None:
        """Load ``scope``'s tensors and those of the ``prefetch_modules`` offloaded scopes
        before it (the order backward will need them); kept scopes use no look-ahead."""
        if self._prefetch is None:
            return
        budget = self._prefetch_modules
        scopes = scope.record.scopes
        wanted: list[Entry] = []
        for index in range(scope.index, -1, -1):
            current = scopes[index]
            if index != scope.index:
                if current.keep:
                    continue
                if budget == 0:
                    break
                budget -= 1
            wanted.extend(reversed(current.entries))  # backward needs the last saved first
        self._prefetch(wanted)

    def set_stage(self, hint: StageHint) -> None:
        self.hint = hint
        for key in hint.prefetch_keys:
            record = self.records.get(key)
            if record is not None and record.scopes:
                self.prefetch_from(record.scopes[-1])
        if hint.next_action is None:
            self.maybe_end_step()

    def close(self) -> None:
        self.closed = True
        for record in self.records.values():
            self._detach(record)
        self.records.clear()
