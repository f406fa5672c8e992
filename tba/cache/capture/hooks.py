"""`CacheHooks`: PyTorch's module hooks, turned into the tracker's events.

The model owns its cache through these hooks (Note [The model owns its cache] in
tba/cache/tensor_cache.py): each module hook holds this object, which holds the cache.
Saved-tensor hooks are thread-local in PyTorch, so each thread that runs a forward of the model
enters its own ``saved_tensors_hooks`` context and keeps its own nesting depth, unit stack and
skip depth (``ThreadState``); records, entries and transfers are shared.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tba import _torch_compat as compat
from tba.cache.capture.hook_stack import ChainedHooks, hooks_for_forward
from tba.cache.capture.module_hook import ModuleHook
from tba.cache.capture.parameters import ParameterStorages
from tba.cache.capture.run_order import RunOrder
from tba.cache.capture.saving import SavedTensors
from tba.cache.engine import Engine, interrupts
from tba.cache.steps.forward_state import on_stack, torch_caller
from tba.cache.steps.scopes import Scope, Unit, matches
from tba.cache.steps.steps import Steps
from tba.cache.steps.tracker import StepTracker
from tba.config import TensorCacheConfig

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["CacheHooks"]


class CacheHooks:
    """Hooks ``model``: forwards and units become records and scopes of ``tracker``; each
    forward enters ``saved``'s pack and unpack hooks.

    Args:
        owner: what the hooks keep alive (the cache: Note [The model owns its cache]); only
            held, never called, so the hooks know nothing of its type.
    """

    def __init__(
        self,
        owner: object,
        model: nn.Module,
        config: TensorCacheConfig,
        units: list[Unit],
        engine: Engine,
        tracker: StepTracker,
        saved: SavedTensors,
        steps: Steps,
        run_order: RunOrder,
    ) -> None:
        self.owner = owner
        self.config = config
        self.units = units
        self.engine = engine
        self.tracker = tracker
        self.saved = saved
        self.steps = steps
        self.run_order = run_order
        self._handles: list[RemovableHandle] = []
        self.parameter_storages = ParameterStorages()
        # While set, forwards enter this pack hook instead of ``saved.pack`` (a wrapper that
        # samples what is saved, Note [Loud when it does nothing]); told when a forward runs
        # without grad.
        self.sampled_pack: Callable[[torch.Tensor], Any] | None = None
        self.watch_pack: Callable[[torch.Tensor], Any] | None = None  # probe(cache).watch_saves()
        self.on_forward_skipped: Callable[[bool], object] | None = None
        # Told when the script's own pack keeps a save (the arbitrary thing it returned).
        self.on_outer_passed: Callable[[Any], None] | None = None  # told when the script's own pack keeps a save
        self._traced_at_start = compat.num_traced_hooks  # Note [tba under torch.compile]
        self._warned_compiled = False
        self._install(model)

    # ------------------------------------------------------------------ install / remove
    def _install(self, model: nn.Module) -> None:
        add = self._handles.append
        # Note [tba under torch.compile]: what autograd calls from C++ while compiled code runs.
        # A hook called as a frame of its own (by a ``_call_impl`` Dynamo does not trace) runs
        # as plain Python; one Dynamo inlines takes the compiled branch of ModuleHook.__call__.
        compat.keep_dynamo_out(
            compat.call_outside_compile, ModuleHook.__call__, SavedTensors.pack,
            SavedTensors.unpack, StepTracker._grad_fn_entered, StepTracker._backward_ended_hook,
            ChainedHooks.pack, ChainedHooks.unpack,
        )
        add(model.register_forward_pre_hook(ModuleHook(self._root_pre), with_kwargs=True))
        add(model.register_forward_hook(ModuleHook(self._root_post), always_call=True))
        for unit in self.units:
            pre = ModuleHook(functools.partial(self._unit_pre, unit))
            post = ModuleHook(functools.partial(self._unit_post, unit))
            add(unit.module.register_forward_pre_hook(pre))
            # The model itself as its only unit (it has no submodules): its unit ends before
            # its forward does.
            add(unit.module.register_forward_hook(post, always_call=True,
                                                  prepend=unit.module is model))
        skip = self.config.skip_modules
        for name, module in model.named_modules():
            if name and matches(module, name, skip):
                add(module.register_forward_pre_hook(ModuleHook(self._skip_pre)))
                add(module.register_forward_hook(ModuleHook(self._skip_post), always_call=True))

    @property
    def num_handles(self) -> int:
        """Module hooks installed (for ``tba.testing.probe``)."""
        return len(self._handles)

    def note_compile(self) -> None:
        """Say once when Dynamo traced tba's hooks since the cache was made (Note [tba under
        torch.compile]): the model runs inside compiled code and breaks at tba's units."""
        if self._warned_compiled or compat.num_traced_hooks == self._traced_at_start:
            return
        self._warned_compiled = True
        warnings.warn(
            "tba: the model runs under torch.compile with tba's module hooks inside the compiled "
            "code: Dynamo breaks the graph where it meets them, at the boundaries of tba's "
            f"{len(self.units)} units (blocks and the modules around them), and the hooks run "
            "outside the graphs. Those breaks are what lets tba offload during forward: a "
            "compiled graph's saved tensors are packed only when it returns (pytorch#148222). "
            "For no breaks from tba, compile with tba's backend, which offloads inside the "
            "compiled graph (torch.compile(model, backend=\"tba\")), or compile each block "
            "(torch.compile(block) or block.compile()) instead of the whole model "
            "(docs/integrations.md, torch.compile). "
            "(Shown once.)",
            UserWarning,
            stacklevel=1,
        )

    def remove(self) -> None:
        """Remove every module hook; leave the saved-tensor hooks of this thread's running
        forward (lock held by the caller)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        state = self.tracker.local
        state.leave_hooks()
        state.forward.end()

    # ------------------------------------------------------------------ module hooks
    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled() or compat.in_backward():
            if self.on_forward_skipped is not None:
                self.on_forward_skipped(compat.in_backward())
            return
        # Under backend="tba" the model's own hooks run eagerly around its compiled forward:
        # they open its record and enter no saved-tensor hooks; the graphs' store ops save
        # into it (Note [The cache under compiled graphs] in tba/cache/capture/compiled.py).
        compiled = compat.running_for_tba()
        if not compiled and compat.in_functorch_transform():
            self.saved._functorch_note()
            return  # torch.func refuses saved-tensor hooks: autograd keeps everything
        engine, tracker = self.engine, self.tracker
        engine.raise_pending()
        state = tracker.local
        caller = torch_caller()
        interrupts.install()
        with engine.lock:
            if engine.released:
                engine._drain_locked()
            if state.depth and not on_stack(state.caller_id, caller):
                tracker.abandon_forward(state)  # Note [Interrupted forwards]
            if not state.depth:
                if compiled:
                    self.open_forward(module, (args, kwargs))
                    state.compiled, state.caller_id = True, id(caller)
                else:
                    self._begin_forward(module, (args, kwargs), caller)
            state.depth += 1
        if interrupts.pending:
            interrupts.raise_pending()

    def _begin_forward(self, model: nn.Module, inputs: Any, caller: FrameType | None) -> None:
        """This thread's outermost forward of the model begins (lock held); ``inputs`` are its
        positional and keyword arguments."""
        state, saved = self.tracker.local, self.saved
        self.open_forward(model, inputs)
        pack: Callable[[torch.Tensor], Any]  # returns what the unpack hook takes (arbitrary)
        if compat.capturing():  # once per forward: a capture does not start inside one
            pack = saved.captured  # Note [CUDA-graph capture]
        else:
            pack = self.watch_pack or self.sampled_pack or saved.pack
        # Note [Outer saved-tensor hooks]: chained to the script's pair, if any.
        pack, unpack = hooks_for_forward(pack, saved, self.on_outer_passed)
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        state.ctx, state.caller_id, state.epoch = ctx, id(caller), interrupts.interrupt_count

    def open_forward(self, model: nn.Module, inputs: Any) -> None:
        """A forward of ``model`` opens its record on this thread (lock held): the step, the
        profile, the tail. The eager forward's saved-tensor hooks, or the store ops of a graph
        compiled by ``backend="tba"`` (tba/cache/capture/compiled.py), then save into it."""
        steps = self.steps
        # Note [Parameter storages, checked not rebuilt]
        self.saved.param_ptrs = self.parameter_storages.current(model)
        record, opened = self.tracker.begin_forward()
        profile = steps.profile
        steps.begin_forward(inputs, opened)
        # Note [Closed loop]: a keep step offloads nothing. Read after the steps have begun
        # this forward: a profile due now (new input shapes) sets the boundary back.
        record.in_tail = self.tracker.boundary.keep_all
        if steps.profile is not profile and steps.profile is not None:
            self.run_order.start()  # Note [Blocks in run order]: observed again with each profile

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self.tracker.local
        if (state.ctx is None and not state.compiled) or compat.in_backward():
            return
        engine = self.engine
        # Note [Interrupted forwards]: torch runs this always_call hook with no output while
        # an exception leaves the forward.
        raised = output is None and sys.exc_info()[1] is not None
        with engine.lock:
            state.depth -= 1
            if state.depth <= 0 and raised:
                self.tracker.abandon_forward(state)
            elif state.depth <= 0:
                state.leave_hooks()
                self.close_forward()
        engine.flush()
        if interrupts.pending:
            interrupts.raise_pending()

    def close_forward(self) -> None:
        """This thread's forward of the model ends (lock held; ``open_forward``'s pair)."""
        self.steps.end_forward()
        if self.run_order.observing:
            self.run_order.finish(self.steps.profile)
        self.tracker.end_forward(self.tracker.local)
        if self.engine.released:
            self.engine._drain_locked()

    def _unit_pre(self, unit: Unit, module: nn.Module, args: Any) -> None:
        state = self.tracker.local
        if state.ctx is None or compat.in_backward():
            return
        self.enter_unit(unit)

    def enter_unit(self, unit: Unit) -> None:
        """``unit`` begins in this thread's open forward: what it saves goes to its scope."""
        self.tracker.local.forward.enter(unit, self.tracker.boundary.tail_start)
        if self.run_order.observing:
            self.run_order.saw(unit)
        profile = self.steps.profile
        if profile is not None and unit.block_index is not None:
            profile.start(unit.block_index)

    def exit_unit(self, unit: Unit) -> Scope | None:
        """``unit`` ends (``enter_unit``'s pair); its scope, if it saved anything."""
        scope = self.tracker.local.forward.exit()
        profile = self.steps.profile
        if profile is not None and unit.block_index is not None:
            profile.end(unit.block_index)
        return scope

    def _unit_post(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        state = self.tracker.local
        if state.ctx is None or compat.in_backward():
            return
        scope = self.exit_unit(unit)
        engine = self.engine
        if scope is not None and scope.record.offloads:  # Note [Prefetch hooks]
            with engine.lock:
                self.tracker.unit_exited(scope, output)
        engine.flush()
        if interrupts.pending:
            interrupts.raise_pending()

    def _skip_pre(self, module: nn.Module, args: Any) -> None:
        state = self.tracker.local
        if state.ctx is not None and not compat.in_backward():
            with self.engine.lock:  # the stack and ``state.aside`` change together
                state.enter_skipped()  # Note [Stepping aside]
            if interrupts.pending:
                interrupts.raise_pending()

    def _skip_post(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self.tracker.local
        if state.ctx is not None and not compat.in_backward():
            with self.engine.lock:
                state.leave_skipped()
            if interrupts.pending:
                interrupts.raise_pending()
