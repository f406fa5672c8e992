"""`CompiledForwards`: the cache's side of graphs compiled by tba's backend (tba/compile).

Note [The cache under compiled graphs]: in a graph compiled with ``backend="tba"`` tba's
module hooks trace to nothing and the graph's store ops do their work, in graph order. The
model's own hooks are not traced (Dynamo skips ``Module._call_impl``): they run eagerly around
the compiled forward and open and close its record (``CacheHooks.open_forward`` and
``close_forward``: step, profile, tail) without entering saved-tensor hooks, so every graph of
one forward (the model's own graph breaks make several) saves into one record. Where the
configured model's hooks were traced instead (a module around it was compiled), the first
store of a graph opens the forward and its last store closes it. Each store enters its
group's unit (``enter_unit``, as a unit's pre-hook does; leaving the unit before stores its
pending batch and wakes the store threads, ``engine.flush``, as its post-hook does) and hands the tensors to the engine
as the pack hook would have (dedup, parameters, the policy's keep or offload: ``save_group``). Reload ops hand the packed values to
``SavedTensors.unpack``: fetch, stall accounting, the end-of-backward callback that ends the
step, every error. So the compiled path shares the engine, offloaders, accounting, stats,
summary, trace and invariant checks with eager mode; what differs is only who calls them.

Note [Compiled saves are plain views]: what a compiled graph hands a store is a tensor of
the graph's own making (Inductor's ``reinterpret_tensor`` views have no ``_base`` and a
version counter of their own, and a custom op's ``detach()`` starts a new counter), so the
eager identity of Note [Version-counter families] cannot group them and the saved-version
check would compare unrelated counters. The graph is functional (nothing writes a saved
tensor; Note [Stored buffers are not reused] in tba/compile/lowering.py), so a group is saved
as plain views of its storage, all of one family made for the group: one entry per storage,
one handle per member, the member's geometry kept in the handle, versions that agree. A group
of one member is saved as a ``detach()`` of the tensor the graph handed over, a family of its
own (a view made with ``set_`` cost a third of a store's time: 10 us of 31, GPT-2 6 x 128 on
CPU). An op's kernel runs below autograd's view tracking, where ``detach()`` starts a counter
of its own (the tensor's counts the graph's writes before the store; the cache would compare the
two), and the entry's alias, a ``detach()`` too, agrees with it.

A store op that runs inside an eager forward of the same cache (a block compiled with
``backend="tba"`` inside a model configured as usual) raises a TBAError: the eager forward's
saved-tensor hooks would take the graph's keys at its return and hand back copies. Per-block
compile keeps the default backend, with tba's hooks around the blocks. A run cut short by an exception is closed by the next run's
first store on the thread (``tracker.abandon_forward``), as Note [Interrupted forwards] does
for eager forwards. Tested by tests/compile/.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tba import _torch_compat as compat
from tba.cache.engine import interrupts
from tba.cache.steps.scopes import Unit
from tba.config import TensorCacheConfig
from tba.errors import TBAError

if TYPE_CHECKING:
    from torch import nn

    from tba.cache.capture.hooks import CacheHooks
    from tba.cache.capture.saving import SavedTensors

__all__ = ["CompiledForwards"]

_NO_UNIT = object()  # the open run has entered no unit yet


class _ThreadRun(threading.local):
    def __init__(self) -> None:
        self.open = False  # a compiled graph's stores run on this thread
        self.nested = False  # in a forward the model's own hooks opened
        self.unit: object = _NO_UNIT


class CompiledForwards:
    """What the ops of a graph compiled with ``backend="tba"`` call on one cache (Note [The
    cache under compiled graphs]). Holds the cache's parts, never the cache itself, so a live
    compiled graph does not keep the cache alive (Note [The model owns its cache]); made by
    ``TensorCache._compiled_forwards``.

    Args:
        hooks: the cache's module hooks (weakly: the model holds them).
        model: the configured model (weakly).
        saved: the cache's pack and unpack hooks.
        config: the cache's options.
        units: the cache's units.
    """

    def __init__(self, hooks: weakref.ref[CacheHooks], model: weakref.ref[nn.Module],
                 saved: SavedTensors, config: TensorCacheConfig, units: list[Unit]) -> None:
        self._hooks = hooks
        self._model = model
        self.saved = saved
        self.config = config
        self._units = {unit.name: unit for unit in units}
        self._longest_first = sorted(self._units, key=len, reverse=True)
        self._paths: dict[str, Unit | None] = {}
        self._at: dict[tuple[int, str | None, str | None], Unit | None] = {}  # unit_at's answers
        self._names: dict[int, str] = {}  # parameter and buffer data pointers -> their names
        self._run = _ThreadRun()

    @property
    def closed(self) -> bool:
        return self.saved.closed

    def unit_of(self, path: str) -> Unit | None:
        """The unit a module at ``path`` (as ``named_modules`` spells it) runs in, or None."""
        if path not in self._paths:
            found = None
            for name in self._longest_first:
                if name == "" or path == name or path.startswith(name + "."):
                    found = self._units[name]
                    break
            self._paths[path] = found
        return self._paths[path]

    def unit_at(self, module: str | None, marker: torch.Tensor | None,
                marker_path: str | None) -> Unit | None:
        """The unit of a group saved in ``module``, a path relative to the module whose frame
        was compiled; ``marker``, a parameter of that frame at ``marker_path``, tells where
        the frame is in the model (Note [Units at run time] in tba/compile/plan.py)."""
        key = (marker.data_ptr() if marker is not None else 0, module, marker_path)
        if key in self._at:
            return self._at[key]
        prefix = ""
        if marker is not None and marker_path:
            name = self._name_of(marker)
            if name is not None and (name == marker_path or name.endswith("." + marker_path)):
                prefix = name[: len(name) - len(marker_path)]
        path = prefix + module if module else prefix[:-1]
        unit = self._at[key] = self.unit_of(path) if path or "" in self._units else None
        return unit

    def _name_of(self, tensor: torch.Tensor) -> str | None:
        ptr = tensor.data_ptr()
        name = self._names.get(ptr)
        if name is None:
            model = self._model()
            if model is not None:  # parameters moved since the names were read: read again
                self._names = {t.data_ptr(): n for n, t in itertools.chain(
                    model.named_parameters(), model.named_buffers())}
                name = self._names.get(ptr)
        return name

    def _live_hooks(self) -> CacheHooks:
        hooks = self._hooks()
        if hooks is None or self.saved.closed:
            raise TBAError(
                "tba: a graph compiled with backend=\"tba\" ran after its tensor cache was "
                "closed; configure the model again (tba.configure_tensor_cache: the compiled "
                "graph uses the new cache) or call torch.compiler.reset() and compile again"
            )
        return hooks

    def begin(self, inputs: Any) -> None:
        """A compiled forward's first store: open the forward on this thread (``inputs``: what
        the profile's shape check compares from step to step)."""
        hooks = self._live_hooks()
        engine, tracker = self.saved.engine, self.saved.tracker
        engine.raise_pending()
        interrupts.install()
        state, run = tracker.local, self._run
        if state.ctx is not None:
            raise TBAError(
                "tba: a graph compiled with backend=\"tba\" ran inside an eager forward of the "
                "configured model (a block compiled with backend=\"tba\"?): compile the whole "
                "model with backend=\"tba\", or compile blocks with the default backend (tba's "
                "hooks then run around them; docs/integrations.md, torch.compile)"
            )
        model = self._model()
        if model is None:
            raise TBAError("tba: a compiled graph ran after its model was collected")
        with engine.lock:
            if engine.released:
                engine._drain_locked()
            if run.open and not run.nested:
                tracker.abandon_forward(state)  # the last run on this thread raised midway
            run.open, run.unit, run.nested = True, _NO_UNIT, state.compiled
            if not run.nested:
                hooks.open_forward(model, inputs)
                state.depth = 1
        if interrupts.pending:
            interrupts.raise_pending()

    def enter(self, unit: Unit | None) -> None:
        """The next store belongs to ``unit`` (None: outside every unit)."""
        run = self._run
        if unit is run.unit:
            return
        hooks = self._live_hooks()
        if isinstance(run.unit, Unit):
            hooks.exit_unit(run.unit)
            # What a unit's post-hook does in eager mode: its pending batch stored, the
            # workers woken for its stores (Note [Small transfers in batches]).
            self.saved.engine.flush()
        if unit is not None:
            hooks.enter_unit(unit)
        run.unit = unit

    def save_group(self, tensors: list[torch.Tensor]) -> list[Any]:
        """What autograd's pack hook keeps, for each tensor of one storage's group (Note
        [Compiled saves are plain views]): handles of one entry, or, for a storage tba does
        not manage (no bytes of its own, a parameter's), the tensors themselves."""
        saved = self.saved
        engine = saved.engine
        if engine.error is not None:
            engine.raise_pending()
        storage = tensors[0].untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in saved.param_ptrs:
            return [(tensor, tensor._version) for tensor in tensors]
        forward = saved.tracker.local.forward
        scope = forward.scope()
        offload = saved.offloading and not scope.keep and forward.skip_depth == 0
        if len(tensors) == 1:  # a family of one: an alias of the tensor
            views = [tensors[0].detach()]
        else:
            views = [compat.view_on_storage(storage, t.dtype, t.size(), t.stride(),
                                            int(t.storage_offset())) for t in tensors]
        packed = []
        for view in views:
            handle = engine.save(view, storage, views[0], scope, scope.record, offload)
            entry = handle.entry
            if entry() is handle:  # a new entry (Note [One object per new entry])
                saved.profile_bytes(scope, entry.nbytes)
            packed.append(handle)
        if interrupts.pending:
            interrupts.raise_pending()
        return packed

    def end(self) -> None:
        """The compiled forward's last store: close the forward."""
        run = self._run
        if not run.open:
            return
        run.open = False
        hooks = self._live_hooks()
        engine = self.saved.engine
        if isinstance(run.unit, Unit):
            hooks.exit_unit(run.unit)
        run.unit = _NO_UNIT
        if not run.nested:
            with engine.lock:
                self.saved.tracker.local.depth = 0
                hooks.close_forward()
        engine.flush()
        if interrupts.pending:
            interrupts.raise_pending()
