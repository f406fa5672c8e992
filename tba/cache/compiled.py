"""`CompiledForwards`: the cache's side of graphs compiled by tba's backend (tba/compile).

Note [The cache under compiled graphs]: in a graph compiled with ``backend="tba"`` tba's
module hooks trace to nothing and the graph's store ops do their work, in graph order: the
first store of a run opens the forward (``CacheHooks.open_forward``, as the root pre-hook
does: record, step, profile, tail), each store enters its group's unit (``enter_unit``, as a
unit's pre-hook does) and hands the tensors to ``SavedTensors.pack`` exactly as autograd would
have (dedup, parameters, devices, the version check, the policy's keep or offload), and the
last store closes the forward (``close_forward``). Reload ops hand the packed values to
``SavedTensors.unpack``: fetch, stall accounting, the end-of-backward callback that ends the
step, every error. So the compiled path shares the engine, offloaders, accounting, stats,
summary, trace and invariant checks with eager mode; what differs is only who calls them.

A store op that runs inside an eager forward of the same cache (a block compiled with
``backend="tba"`` inside a model configured as usual) opens nothing: its tensors go to the
scope the eager hooks opened. A run cut short by an exception is closed by the next run's
first store on the thread (``tracker.abandon_forward``), as Note [Interrupted forwards] does
for eager forwards. Tested by tests/compile/.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tba.cache import interrupts
from tba.cache.scopes import Unit
from tba.errors import TBAError

if TYPE_CHECKING:
    from tba.cache.hooks import CacheHooks
    from tba.cache.saving import SavedTensors
    from tba.cache.tensor_cache import TensorCache

__all__ = ["CompiledForwards", "compiled_forwards"]

_NO_UNIT = object()  # the open run has entered no unit yet


class _ThreadRun(threading.local):
    def __init__(self) -> None:
        self.open = False  # a compiled forward of this cache is open on this thread
        self.nested = False  # it runs inside an eager forward of the cache (opens nothing)
        self.unit: object = _NO_UNIT


class CompiledForwards:
    """What the ops of a graph compiled with ``backend="tba"`` call on one cache (Note [The
    cache under compiled graphs]). Holds the cache's parts, never the cache itself, so a live
    compiled graph does not keep the cache alive (Note [The model owns its cache]).

    Args:
        cache: the tensor cache the graph offloads with.
    """

    def __init__(self, cache: TensorCache) -> None:
        self._hooks: weakref.ref[CacheHooks] = cache._hooks
        self._model = cache._model
        self.saved: SavedTensors = cache._saved
        self.config = cache.config
        self._units = {unit.name: unit for unit in cache.units}
        self._run = _ThreadRun()

    @property
    def closed(self) -> bool:
        return self.saved.closed

    def unit(self, name: str | None) -> Unit | None:
        """The cache's unit called ``name`` (None: outside every unit)."""
        return self._units.get(name) if name is not None else None

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
        with engine.lock:
            if engine.released:
                engine._drain_locked()
            if run.open and not run.nested:
                tracker.abandon_forward(state)  # the last run on this thread raised midway
            run.open, run.unit = True, _NO_UNIT
            run.nested = state.ctx is not None
            if not run.nested:
                model = self._model()
                if model is None:
                    raise TBAError("tba: a compiled graph ran after its model was collected")
                hooks.open_forward(model, inputs)
                state.depth = 1
        if interrupts.pending:
            interrupts.raise_pending()

    def enter(self, name: str | None) -> None:
        """The next store belongs to unit ``name`` (None: outside every unit)."""
        run = self._run
        if run.nested:
            return
        unit = self.unit(name)
        if unit is run.unit:
            return
        hooks = self._live_hooks()
        if isinstance(run.unit, Unit):
            hooks.exit_unit(run.unit)
        if unit is not None:
            hooks.enter_unit(unit)
        run.unit = unit

    def save(self, tensor: torch.Tensor) -> Any:
        """What autograd's pack hook would have kept for ``tensor``."""
        return self.saved.pack(tensor)

    def end(self) -> None:
        """The compiled forward's last store: close the forward."""
        run = self._run
        if not run.open:
            return
        run.open = False
        if run.nested:
            run.nested = False
            return
        hooks = self._live_hooks()
        engine = self.saved.engine
        if isinstance(run.unit, Unit):
            hooks.exit_unit(run.unit)
        run.unit = _NO_UNIT
        with engine.lock:
            self.saved.tracker.local.depth = 0
            hooks.close_forward()
        engine.flush()
        if interrupts.pending:
            interrupts.raise_pending()


_seams: weakref.WeakKeyDictionary[TensorCache, CompiledForwards] = weakref.WeakKeyDictionary()
_seams_lock = threading.Lock()


def compiled_forwards(cache: TensorCache) -> CompiledForwards:
    """The one ``CompiledForwards`` of ``cache``."""
    with _seams_lock:
        seam = _seams.get(cache)
        if seam is None:
            seam = _seams[cache] = CompiledForwards(cache)
        return seam
