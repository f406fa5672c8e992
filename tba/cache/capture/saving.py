"""`SavedTensors`: the pack and unpack hooks (which saved tensors tba manages, and how they
come back).

Autograd keeps the hook pair with every tensor it saves, so a live graph holds this object: it
refers to the engine, the tracker and the steps, never to the cache, its hooks or the model
(Note [Graphs do not own the model] in tba/cache/steps/scopes.py).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from tba import _torch_compat as compat
from tba.cache.capture.packed import (
    NESTED_TYPE_NAME, PackedSubclass, modified_error, offloadable_subclass,
)
from tba.cache.engine import Engine, Handle, interrupts
from tba.cache.steps.forward_state import ThreadState, on_stack
from tba.cache.steps.tracker import StepTracker
from tba.errors import TBAError

if TYPE_CHECKING:
    from tba.cache.steps.scopes import Scope
    from tba.cache.steps.steps import Steps

__all__ = ["SavedTensors"]

logger = logging.getLogger(__name__)

_TENSOR = torch.Tensor
_STRIDED = torch.strided
_PARAMETER = torch.nn.Parameter


# Note [Parameters are never offloaded]: a parameter's bytes are held by its module anyway:
# storing them saves nothing and reads a storage its owner may free. FSDP2 all-gathers each
# block's parameters into fresh storages inside the forward (after the root pre-hook took
# ``param_ptrs``) and, with ``reshard_after_forward=True``, frees them with
# ``storage.resize_(0)`` after the block, while a queued store could still be reading them.
# Autograd saves a parameter itself or a view of it (``linear`` saves ``weight.t()``, whose
# ``_base`` is the parameter): both are left to autograd, for a parameter of any module
# (an outer module's frozen weight passed into the configured one too), trainable or frozen:
# a leaf that requires grad, or an ``nn.Parameter`` (a frozen one requires no grad: its type,
# or ``_is_param`` for parameters of tensor subclasses, says what it is). ``param_ptrs``
# covers the configured model's parameters and buffers by storage (DTensor shards, tied and
# flat parameters, tensors sharing their bytes). Tested by tests/cache/test_parameters.py and
# tests/integrations/test_fsdp.py.


# Note [What tba manages]: the pack hook takes (may offload) a plain ``torch.Tensor`` on a
# device of ``offload_devices``, strided, without a lazy conjugate or negative bit, neither
# nested (strided layout) nor quantized, not a parameter nor a view of one, whose storage has
# bytes of its own (a readable, nonzero address), and the inner tensors of DTensors, jagged
# nested tensors and float8 tensors (Note [Subclasses with pending work]). Everything else goes
# back to autograd as it is, with its version at pack: sparse and other layouts, strided nested
# (a buffer with per-component sizes a strided view cannot restore), quantized (``set_`` has no
# quantized kernel), conjugate/negative views (the bit is lost on a view of the storage),
# efficient zero tensors (forward AD's tangents of tensors without one: their storage raises on
# ``data_ptr()``), meta and empty tensors (address 0), other subclasses, torch.func wrappers. A
# forward-AD dual tensor's primal is managed: autograd saves its tangent apart from what the
# pack hook returns and attaches it again at unpack. The checks are ordered so that the common
# plain tensor pays one read per property and no call that can raise; the rare kinds cost more.
# Tested by tests/cache/test_saved_kinds.py.


def _is_parameter_tensor(tensor: torch.Tensor) -> bool:
    """A leaf that requires grad or an ``nn.Parameter`` (not a view of one)."""
    return tensor.is_leaf and (
        tensor.requires_grad or type(tensor) is _PARAMETER or getattr(tensor, "_is_param", False)
    )


class SavedTensors:
    """The saved-tensor hooks of one cache.

    Args:
        engine: the entries' owner.
        tracker: the records, scopes and this thread's forward.
        steps: its ``profile``, while a step profile is taken, counts the bytes saved per block.
        devices: device types whose tensors are managed.
        offloading: whether the cache has an offloader.
        min_offload_bytes: smaller storages are never offloaded (for the profile's counts).
    """

    def __init__(
        self,
        engine: Engine,
        tracker: StepTracker,
        steps: Steps,
        devices: frozenset[str],
        offloading: bool,
        min_offload_bytes: int,
    ) -> None:
        self.engine = engine
        self.tracker = tracker
        self._steps = steps
        self._devices = devices
        # ``tensor.device`` builds a torch.device per call; the common cases use the tensor's
        # cheap predicates instead.
        self._device_only = next(iter(devices)) if len(devices) == 1 else None
        self._offloading = offloading
        self._min_offload_bytes = min_offload_bytes
        self.param_ptrs: frozenset[int] = frozenset()
        self.closed = False
        self.num_captured = 0
        self.num_record_stream = 0
        self._warned_functorch = False
        self._warned_capture = False
        self._noted_subclasses: set[type] = set()

    # ------------------------------------------------------------------ pack
    def pack(self, tensor: torch.Tensor) -> Any:
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
            or tensor.is_nested
            or tensor.is_quantized
        ):
            # Parameters and tensors tba does not manage stay with autograd, with their
            # version at pack (Note [Saved-version check]): Note [What tba manages].
            return (tensor, tensor._version)
        base = tensor._base
        if base is None:
            root = tensor
        elif base.is_leaf and (
            base.requires_grad or type(base) is _PARAMETER or getattr(base, "_is_param", False)
        ):
            return (tensor, tensor._version)  # Note [Parameters are never offloaded]
        else:
            root = base
        try:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
        except NotImplementedError:  # torch.func wrappers (vmap inside a forward)
            self._functorch_note()
            return (tensor, tensor._version)
        except RuntimeError:  # no readable storage: efficient zero tensors (forward AD)
            return (tensor, tensor._version)
        if ptr == 0 or ptr in self.param_ptrs:
            return (tensor, tensor._version)
        state = self.tracker.local
        if state.epoch != interrupts.interrupt_count and self._abandoned(state):
            return (tensor, tensor._version)
        forward = state.forward
        units = forward.units
        scope = units[-1][1] if units else None
        if scope is None:
            scope = forward.scope()
        handle = engine.save(
            tensor, storage, root, scope, scope.record,
            self._offloading and not scope.keep and forward.skip_depth == 0,
        )
        if self._steps.profile is not None:
            entry = handle.entry
            if entry() is handle:  # a new entry (Note [One object per new entry])
                self.profile_bytes(scope, entry.nbytes)
        if interrupts.pending:
            interrupts.raise_pending()
        return handle

    @property
    def offloading(self) -> bool:
        """Whether the cache has an offloader (a save may be offloaded)."""
        return self._offloading

    def profile_bytes(self, scope: Scope, nbytes: int) -> None:
        """A new entry of ``nbytes`` in ``scope``: count it in the step profile, if one is
        taken and the entry could be offloaded."""
        profile = self._steps.profile
        if profile is not None and scope.unit is not None:
            block = scope.unit.block_index
            if block is not None and nbytes >= self._min_offload_bytes:
                profile.add_bytes(block, nbytes)

    def is_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter of any module, a view of one, or on the storage
        of one of the configured model's parameters or buffers (Note [Parameters are never
        offloaded]; for saves that reach tba through the script's own pack hook)."""
        base = tensor._base
        if _is_parameter_tensor(tensor) or (base is not None and _is_parameter_tensor(base)):
            return True
        try:
            ptr = compat.local_tensor(tensor).untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError):
            return False
        return ptr != 0 and ptr in self.param_ptrs

    def _abandoned(self, state: ThreadState) -> bool:
        """Note [Interrupted forwards]: a KeyboardInterrupt was raised since this thread's
        forward began; if that forward is no longer on the stack (the interrupt ended it and
        another module runs now), close it and leave this save to autograd."""
        state.epoch = interrupts.interrupt_count
        if state.ctx is None or on_stack(state.caller_id, sys._getframe(1)):
            return False
        with self.engine.lock:
            self.tracker.abandon_forward(state)
        return True

    def captured(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
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
        if _is_parameter_tensor(tensor):
            return (tensor, tensor._version)  # Note [Parameters are never offloaded]
        if not offloadable_subclass(type(tensor)):
            self._note_unsafe_subclass(type(tensor))
            return (tensor, tensor._version)
        # torch's Tensor stub lacks the subclass protocol's __tensor_flatten__ (checked above).
        names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        nested = type(tensor).__name__ == NESTED_TYPE_NAME
        inner: dict[str, Any] = {}
        for name in names:
            value = getattr(tensor, name)
            if not isinstance(value, torch.Tensor) or (nested and name != "_values"):
                inner[name] = value
                continue
            packed = self.pack(value)
            if type(packed) is Handle and packed.entry.xfer is None:
                packed = value  # kept anyway: hand back the object itself
            elif type(packed) is tuple:
                packed = value
            inner[name] = packed
        if not any(type(p) in (Handle, PackedSubclass) for p in inner.values()):
            return (tensor, tensor._version)
        return PackedSubclass(type(tensor), inner, context, tensor.size(), tensor.stride())

    # ------------------------------------------------------------------ unpack
    def unpack(self, packed: Any) -> torch.Tensor:
        # ``packed``: what ``pack`` returned (dispatched on its exact type, for speed).
        tensor: torch.Tensor
        storage: torch.UntypedStorage | None
        cls = type(packed)
        if cls is tuple:
            tensor, version = packed
            if tensor._version != version:
                raise modified_error(tuple(tensor.shape), tensor.dtype, None, version, tensor._version)
            return tensor
        if cls is PackedSubclass:
            inner = {name: self.unpack(p) if type(p) in (Handle, PackedSubclass, tuple) else p
                     for name, p in packed.inner.items()}
            tensor = packed.cls.__tensor_unflatten__(inner, packed.context, packed.size, packed.stride)
            return tensor
        if cls is not Handle:
            tensor = packed
            return tensor
        engine = self.engine
        if engine.error is not None:
            engine.raise_pending()
        if self.closed:
            raise TBAError(
                "tba: backward reached an activation after its tensor cache was closed (by "
                "TensorCache.close(), by configuring the model again, or because the model was "
                "collected); close the cache only after the last backward"
            )
        entry = packed.entry
        alias = entry.alias
        if alias is None or alias._version != entry.version:
            self._raise_modified(packed)
        scope = packed.scope
        if not scope.backward_entered or scope.record.detached:
            with engine.lock:
                self.tracker.backward_entered(scope)
        xfer = entry.xfer
        if xfer is None:  # kept in memory since it was saved: no lock needed
            if engine.released:
                engine.drain()
            view = packed.view
            # The first saver's tensor is the entry's alias; a later saver's, its own alias.
            tensor = alias if view is None else view
        else:
            storage, event = engine.fetch(entry)
            geometry = packed.view
            if geometry is None:
                if not xfer.reloaded and entry.geometry is None:
                    tensor = alias  # the first saver, never offloaded: the tensor as saved
                    storage = None
                else:
                    geometry = entry.remember_geometry()
            if storage is not None:
                assert type(geometry) is tuple
                dtype, size, stride, offset = geometry
                if xfer.reloaded and xfer.data_offset:  # in its batch's buffer
                    offset = offset + xfer.data_offset // dtype.itemsize
                tensor = compat.view_on_storage(storage, dtype, size, stride, offset)
                if xfer.reloaded and engine.streams.consume(event, tensor, xfer.event):
                    self.num_record_stream += 1
        if interrupts.pending:
            interrupts.raise_pending()
        return tensor

    def _raise_modified(self, packed: Handle) -> NoReturn:
        entry = packed.entry
        view = packed.view
        if isinstance(view, torch.Tensor):
            dtype, size = view.dtype, view.size()
        else:
            dtype, size, _, _ = view or entry.remember_geometry()
        alias = entry.alias
        found = None if alias is None else alias._version
        unit = packed.scope.unit
        raise modified_error(tuple(size), dtype, unit.name if unit is not None else None,
                             entry.version, found)
