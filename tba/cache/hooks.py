"""`CacheHooks`: the module hooks, the saved-tensor hooks and the per-thread forward state.

Saved-tensor hooks are thread-local in PyTorch, so each thread that runs a forward of the
model enters its own ``saved_tensors_hooks`` context and keeps its own nesting depth, unit
stack and skip depth (``ThreadState``); records, entries and transfers are shared.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import warnings
from typing import Any

import torch
from torch import nn

from tba import _torch_compat as compat
from tba.cache.entries import Entry, Handle
from tba.cache.forward_state import ThreadState, on_stack, torch_caller
from tba.cache.module_hook import ModuleHook
from tba.cache.packed import NESTED_TYPE_NAME, PackedSubclass, modified_error, offloadable_subclass
from tba.cache.policy import Boundary
from tba.cache.scopes import ForwardPass, Record, Scope, Unit, matches
from tba.cache.stages import StageHint
from tba.cache.steps import Steps, tensors_in
from tba.cache.table import EntryTable
from tba.cache.transfers import Transfers
from tba.config import TensorCacheConfig
from tba.errors import TBAError

__all__ = ["CacheHooks"]

logger = logging.getLogger(__name__)

_TENSOR = torch.Tensor
_STRIDED = torch.strided


# Note [Parameters are never offloaded]: a parameter's bytes are held by its module anyway:
# storing them saves nothing and reads a storage its owner may free. FSDP2 all-gathers each
# block's parameters into fresh storages inside the forward (after ``_root_pre`` took
# ``_param_ptrs``) and, with ``reshard_after_forward=True``, frees them with
# ``storage.resize_(0)`` after the block, while a queued store could still be reading them.
# Autograd saves a parameter itself (a leaf that requires grad) or a view of it (``linear``
# saves ``weight.t()``, whose ``_base`` is the parameter): both are left to autograd.
# ``_param_ptrs`` covers DTensor shards and buffers. Tested by tests/integrations/test_fsdp.py.


class CacheHooks:
    """Hooks ``model`` and turns its saved tensors into entries of ``table`` moved by ``engine``."""

    def __init__(
        self,
        model: nn.Module,
        config: TensorCacheConfig,
        units: list[Unit],
        table: EntryTable,
        engine: Transfers,
        steps: Steps,
        boundary: Boundary,
        finish_step: Any,
    ) -> None:
        self.model = model
        self.config = config
        self.units = units
        self.table = table
        self.engine = engine
        self.steps = steps
        self.boundary = boundary
        self._finish_step_ref = finish_step  # a weakref.WeakMethod of the cache's
        self._devices = frozenset(config.offload_devices)
        # ``tensor.device`` builds a torch.device per call; the common cases use the tensor's
        # cheap predicates instead.
        self._device_only = next(iter(self._devices)) if len(self._devices) == 1 else None
        self._offloading = engine.offloader is not None
        self._lock = threading.RLock()  # records, hint, step transitions
        self._local = ThreadState()
        self._num_active = 0  # forwards running, all threads
        self._records: dict[tuple[int, int], Record] = {}
        self._auto_keys = itertools.count()
        self._param_ptrs: frozenset[int] = frozenset()
        self._grad_fn_hooks: list[Any] = []
        self._handles: list[Any] = []
        self._hint: StageHint | None = None
        self._warned_functorch = False
        self._noted_subclasses: set[type] = set()
        self._warned_capture = False
        self.num_captured = 0
        self.num_record_stream = 0
        # While set, forwards enter this pack hook instead of ``_pack`` (a wrapper that samples
        # what is saved, Note [Loud when it does nothing]); told when a forward runs without grad.
        self.sampled_pack: Any = None
        self.on_forward_skipped: Any = None
        self._traced_at_start = compat.num_traced_hooks  # Note [tba under torch.compile]
        self._warned_compiled = False
        self.closed = False

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        add = self._handles.append
        model = self.model
        # Note [tba under torch.compile]: what autograd calls from C++ while compiled code runs.
        # A hook called as a frame of its own (by a ``_call_impl`` Dynamo does not trace) runs
        # as plain Python; one Dynamo inlines takes the compiled branch of ModuleHook.__call__.
        compat.keep_dynamo_out(
            compat.call_outside_compile, ModuleHook.__call__, CacheHooks._pack,
            CacheHooks._unpack, CacheHooks._backward_signal, Handle.__del__,
        )
        add(model.register_forward_pre_hook(ModuleHook(self._root_pre)))
        add(model.register_forward_hook(ModuleHook(self._root_post), always_call=True))
        for unit in self.units:
            pre = ModuleHook(functools.partial(self._unit_pre, unit))
            post = ModuleHook(functools.partial(self._unit_post, unit))
            add(unit.module.register_forward_pre_hook(pre))
            add(unit.module.register_forward_hook(post, always_call=True))
        skip = self.config.skip_modules
        for name, module in model.named_modules():
            if name and matches(module, name, skip):
                add(module.register_forward_pre_hook(ModuleHook(self._skip_pre)))
                add(module.register_forward_hook(ModuleHook(self._skip_post), always_call=True))

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
            "For no breaks from tba, compile each block (torch.compile(block) or "
            "block.compile()) instead of the whole model (docs/integrations.md, torch.compile). "
            "(Shown once.)",
            UserWarning,
            stacklevel=1,
        )

    def remove(self) -> None:
        """Remove every module hook and every grad_fn pre-hook of live graphs; leave the
        saved-tensor hooks of this thread's running forward."""
        self.closed = True
        with self._lock:
            handles = self._handles + self._grad_fn_hooks
            self._handles, self._grad_fn_hooks = [], []
        for handle in handles:
            handle.remove()
        state = self._local
        if state.ctx is not None:
            state.ctx.__exit__(None, None, None)
            state.ctx = None
            state.depth = 0
        state.forward.end()
        with self._lock:
            self._records.clear()

    # ------------------------------------------------------------------ module hooks
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or compat.in_backward():
            if self.on_forward_skipped is not None:
                self.on_forward_skipped(compat.in_backward())
            return
        if compat.in_functorch_transform():
            self._functorch_note()
            return  # torch.func refuses saved-tensor hooks: autograd keeps everything
        state = self._local
        caller = torch_caller()
        if state.depth and not on_stack(state.caller_id, caller):
            self._forget_interrupted_forward(state)
        state.depth += 1
        if state.depth > 1:
            return
        state.caller_id = id(caller)
        self.engine.raise_pending()
        self._param_ptrs = frozenset(
            compat.local_tensor(t).untyped_storage().data_ptr()
            for t in itertools.chain(self.model.parameters(), self.model.buffers())
            if not compat.is_functorch_wrapped(t)  # torch.func.functional_call's stand-ins
        )
        with self._lock:
            self._num_active += 1
            self._begin_record(state, args)
        if compat.capturing():  # once per forward: a capture does not start inside one
            pack = self._captured  # Note [CUDA-graph capture]
        else:
            pack = self._pack if self.sampled_pack is None else self.sampled_pack
        state.ctx = torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)
        state.ctx.__enter__()

    def _forget_interrupted_forward(self, state: ThreadState) -> None:
        """Note [Interrupted forwards]: torch runs ``always_call`` forward hooks for
        ``Exception`` only, so a ``KeyboardInterrupt`` (or ``SystemExit``) raised inside the
        model's forward skips ``_root_post``: this thread's depth, saved-tensor hooks and
        forward record stay as they were. The next forward of the model finds no outer call of
        it on the stack and closes that forward here, so a caught Ctrl-C leaves the cache
        usable."""
        logger.info("tba: the previous forward on this thread was interrupted; closing it")
        if state.ctx is not None:
            state.ctx.__exit__(None, None, None)
            state.ctx = None
        state.depth = 0
        state.forward.end()
        self.engine.flush()
        with self._lock:
            self._num_active = max(0, self._num_active - 1)
            if self._num_active == 0:
                self.steps.end_forward()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._local
        if state.ctx is None or compat.in_backward():
            return
        state.depth -= 1
        if state.depth > 0:
            return
        ctx, state.ctx = state.ctx, None
        ctx.__exit__(None, None, None)
        state.forward.end()
        self.engine.flush()
        with self._lock:
            self._num_active -= 1
            if self._num_active == 0:
                self.steps.end_forward()

    def _begin_record(self, state: ThreadState, args: Any) -> None:
        steps, hint = self.steps, self._hint
        if steps.open and hint is None and self._num_active == 1:
            if self.table.num_entries == 0:
                # The previous forward left nothing in the cache (nothing was managed, or
                # backward released it all): its step is over.
                self._finish_step()
            elif steps.backward_seen and all(r.backward_started for r in self._records.values()):
                # Backward ran for everything, yet some graph is still alive (retain_graph,
                # or a graph kept by the user): the step is over all the same.
                self._finish_step()
        steps.begin_forward(args)
        if hint is not None and hint.action == "forward":
            key, keep_tail = hint.record_key, hint.keeps_tail
        else:
            key, keep_tail = (-1, next(self._auto_keys)), True
        self._records[key] = record = Record(key, keep_tail)
        record.in_tail = self.boundary.keep_all  # Note [Closed loop]: keep steps offload nothing
        state.forward.begin(record)

    def _unit_pre(self, unit: Unit, module: nn.Module, args: Any) -> None:
        state = self._local
        if state.ctx is None or compat.in_backward():
            return
        state.forward.enter(unit, self.boundary.tail_start)
        profile = self.steps.profile
        if profile is not None and unit.block_index is not None:
            profile.start(unit.block_index)

    def _unit_post(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        state = self._local
        if state.ctx is None or compat.in_backward():
            return
        scope = state.forward.exit()
        profile = self.steps.profile
        if profile is not None and unit.block_index is not None:
            profile.end(unit.block_index)
        self.engine.flush()
        if scope is None or self.closed:
            return
        seen: set[int] = set()
        for tensor in tensors_in(output):
            fn = tensor.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                hook = fn.register_prehook(functools.partial(self._backward_signal, scope))
                self._grad_fn_hooks.append(hook)

    def _skip_pre(self, module: nn.Module, args: Any) -> None:
        state = self._local
        if state.ctx is not None and not compat.in_backward():
            state.forward.skip_depth += 1

    def _skip_post(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._local
        if state.ctx is not None and not compat.in_backward() and state.forward.skip_depth:
            state.forward.skip_depth -= 1

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, tensor: torch.Tensor) -> Any:
        # The hot path: every saved tensor of every op comes through here. See
        # benchmarks/hook_overhead.py before adding work.
        engine = self.engine
        if engine.error is not None:
            engine.raise_pending()
        if type(tensor) is not _TENSOR:
            if hasattr(tensor, "__tensor_flatten__"):
                return self._pack_subclass(tensor)
            return (tensor, tensor._version)  # unknown subclasses: autograd keeps them
        device_only = self._device_only
        if (
            not (
                tensor.is_cuda if device_only == "cuda"
                else tensor.is_cpu if device_only == "cpu"
                else tensor.device.type in self._devices
            )
            or (tensor.requires_grad and tensor.is_leaf)
            or tensor.layout is not _STRIDED
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            # Parameters and tensors tba does not manage stay with autograd, with their
            # version at pack (Note [Saved-version check]).
            return (tensor, tensor._version)
        base = tensor._base
        if base is None:
            root = tensor
        elif base.requires_grad and base.is_leaf:
            return (tensor, tensor._version)  # Note [Parameters are never offloaded]
        else:
            root = base
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:  # torch.func wrappers (vmap inside a forward)
            self._functorch_note()
            return (tensor, tensor._version)
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._param_ptrs:
            return (tensor, tensor._version)
        forward = self._local.forward
        units = forward.units
        scope = units[-1][1] if units else None
        if scope is None:
            scope = forward.scope()
        handle, entry = self.table.handle(
            tensor, storage, root, scope,
            self._offloading and not scope.keep and forward.skip_depth == 0,
        )
        if entry is not None:  # a new entry
            profile = self.steps.profile
            if profile is not None and scope.unit is not None:
                block = scope.unit.block_index
                if block is not None and entry.nbytes >= self.config.min_offload_bytes:
                    profile.add_bytes(block, entry.nbytes)
            if entry.offload:
                entry.event = engine.streams.producer_event(tensor.device)
            engine.add(entry)
        else:
            entry = handle.entry
            if scope.keep and entry.offload:
                engine.keep(entry, storage)
        entries = scope.entries
        if not entries or entries[-1] is not entry:
            entries.append(entry)
        return handle

    def _captured(self, tensor: torch.Tensor) -> tuple:
        """Note [CUDA-graph capture]: a save during capture happens once, at capture time,
        while the graph's replays reuse the same memory; events recorded and transfers queued
        now would belong to the capture, and a worker's synchronisation or allocation would
        invalidate it. Such tensors stay with autograd (counted, warned once)."""
        self.num_captured += 1
        if not self._warned_capture:
            self._warned_capture = True
            warnings.warn(
                "tba: tensors saved while a CUDA graph is being captured are not offloaded "
                "(a graph replays its kernels without calling tba's hooks); this warning is "
                "shown once", RuntimeWarning, stacklevel=3,
            )
        return (tensor, tensor._version)

    def _note_unsafe_subclass(self, cls: type) -> None:
        if cls not in self._noted_subclasses:
            self._noted_subclasses.add(cls)
            logger.info(
                "tba: saved tensors of type %s stay with autograd (only DTensor, jagged "
                "NestedTensor and float8 subclasses are offloaded: Note [Subclasses with "
                "pending work])", cls.__name__,
            )

    def _functorch_note(self) -> None:
        if not self._warned_functorch:
            self._warned_functorch = True
            logger.info(
                "tba: forward runs inside a torch.func transform (grad, vmap, ...), which "
                "does not support saved-tensor hooks: tba leaves its activations to autograd"
            )

    def _pack_subclass(self, tensor: torch.Tensor) -> Any:
        """A wrapper subclass (DTensor, jagged NestedTensor, ...): pack the plain tensors it
        holds, rebuild it on unpack through the subclass's flatten/unflatten protocol. Inner
        tensors that stay in memory come back as the very same objects (a jagged tensor's
        offsets identify its ragged dimension: they are never replaced)."""
        if tensor.requires_grad and tensor.is_leaf:
            return (tensor, tensor._version)  # a parameter
        if not offloadable_subclass(type(tensor)):
            self._note_unsafe_subclass(type(tensor))
            return (tensor, tensor._version)
        names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        nested = type(tensor).__name__ == NESTED_TYPE_NAME
        inner: dict[str, Any] = {}
        for name in names:
            value = getattr(tensor, name)
            if not isinstance(value, torch.Tensor) or (nested and name != "_values"):
                inner[name] = value
                continue
            packed = self._pack(value)
            if type(packed) is Handle and not packed.entry.offload:
                packed = value  # kept anyway: hand back the object itself
            elif type(packed) is tuple:
                packed = value
            inner[name] = packed
        if not any(type(p) in (Handle, PackedSubclass) for p in inner.values()):
            return (tensor, tensor._version)
        return PackedSubclass(type(tensor), inner, context, tensor.size(), tensor.stride())

    def _unpack(self, packed: Any) -> torch.Tensor:
        cls = type(packed)
        if cls is tuple:
            tensor, version = packed
            if tensor._version != version:
                raise modified_error(tuple(tensor.shape), tensor.dtype, None, version, tensor._version)
            return tensor
        if cls is PackedSubclass:
            inner = {name: self._unpack(p) if type(p) in (Handle, PackedSubclass, tuple) else p
                     for name, p in packed.inner.items()}
            return packed.cls.__tensor_unflatten__(inner, packed.context, packed.size, packed.stride)
        if cls is not Handle:
            return packed
        engine = self.engine
        if engine.error is not None:
            engine.raise_pending()
        if self.closed:
            raise TBAError(
                "tba: backward reached an activation after TensorCache.close(); "
                "close the cache only after the last backward"
            )
        entry = packed.entry
        alias = entry.alias
        if alias is None or alias._version != entry.version:
            self._raise_modified(packed)
        scope = packed.scope
        if not scope.backward_entered:
            self._backward_signal(scope)
        storage, event = engine.fetch(entry)
        geometry = packed.geometry
        if geometry is None:
            if not entry.reloaded and entry.geometry is None:
                return alias  # the first saver, never offloaded: the tensor as it was saved
            geometry = entry.remember_geometry()
        dtype, size, stride, offset = geometry
        tensor = compat.view_on_storage(storage, dtype, size, stride, offset)
        if entry.reloaded and engine.streams.consume(event, tensor, entry.event):
            self.num_record_stream += 1
        return tensor

    def _raise_modified(self, packed: Handle) -> None:
        entry = packed.entry
        dtype, size, _, _ = packed.geometry or entry.remember_geometry()
        alias = entry.alias
        found = None if alias is None else alias._version
        unit = packed.scope.unit
        raise modified_error(tuple(size), dtype, unit.name if unit is not None else None,
                             entry.version, found)

    # ------------------------------------------------------------------ backward and prefetch
    def _backward_signal(self, scope: Scope, *unused: Any) -> None:
        if self.closed or scope.backward_entered:
            return
        with self._lock:
            scope.backward_entered = True
            scope.record.backward_started = True
            self.steps.backward_seen = True
            self.prefetch_from(scope)

    def prefetch_from(self, scope: Scope) -> None:
        """Load ``scope``'s tensors and those of the ``prefetch_modules`` offloaded scopes
        before it (the order backward will need them); kept scopes use no look-ahead."""
        if not self._offloading:
            return
        budget = self.config.prefetch_modules
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
        self.engine.prefetch_many(wanted)

    def set_stage(self, hint: StageHint) -> None:
        with self._lock:
            self._hint = hint
            for key in hint.prefetch_keys:
                record = self._records.get(key)
                if record is not None and record.scopes:
                    self.prefetch_from(record.scopes[-1])

    def on_empty(self) -> None:
        """The table's last entry was dropped: the step may be over, after backward, or
        because a graph died without one (forward-only with grad enabled)."""
        with self._lock:
            steps, hint = self.steps, self._hint
            if (
                self.table.num_entries == 0
                and not self.closed
                and steps.open
                and (steps.backward_seen or self._num_active == 0)
                and (hint is None or hint.next_action is None)
            ):
                self._finish_step()

    def _finish_step(self) -> None:
        finish = self._finish_step_ref()
        if finish is not None:
            finish()

    def step_finished(self) -> None:
        """Forget the finished step's records and grad_fn hooks (lock held by the caller)."""
        self._records.clear()
        hooks, self._grad_fn_hooks = self._grad_fn_hooks, []
        for hook in hooks:  # graphs still alive (retain_graph) signal backward at first unpack
            hook.remove()

    @property
    def records(self) -> dict[tuple[int, int], Record]:
        return self._records

    @property
    def forward(self) -> ForwardPass:
        """This thread's forward state."""
        return self._local.forward
