"""`TensorCache`: the saved-tensor hooks, module hooks, dedup and step tracking."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
from typing import Any

import torch
from torch import nn

from tba import _torch_compat as compat
from tba.cache.entries import Entry, Handle
from tba.cache.policy import Boundary, BoundaryDecision
from tba.cache.scopes import ForwardPass, Record, Scope, Unit, find_units, matches
from tba.cache.stages import StageHint
from tba.cache.stats import CacheStats, format_summary
from tba.cache.steps import Steps, tensors_in
from tba.cache.streams import DeviceStreams, StreamLayer
from tba.cache.trace import TraceRecorder
from tba.cache.transfers import Transfers
from tba.config import TensorCacheConfig
from tba.errors import TBAError
from tba.offloaders.base import Offloader

__all__ = ["TensorCache", "StageHint"]

logger = logging.getLogger(__name__)

_STAMPS = itertools.count(1)  # Note [Storage stamps]


class TensorCache:
    """Offloads the activations a model saves for backward and brings them back in time.

    Made by :func:`tba.configure_tensor_cache`; see there for an example. The cache enters
    ``saved_tensors_hooks`` around each forward of the model itself and finds step boundaries
    itself; errors from its I/O threads are raised on the training thread.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TensorCacheConfig,
        offloader: Offloader | None,
        *,
        streams: StreamLayer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.offloader = offloader
        self._devices = frozenset(config.offload_devices)
        self._transfers = Transfers(
            offloader,
            streams if streams is not None else DeviceStreams(),
            num_store_threads=config.num_store_threads,
            num_load_threads=config.num_load_threads,
            max_inflight_bytes=config.max_inflight_bytes,
            on_io_error=config.on_io_error,
            trace=TraceRecorder(),
        )
        self._lock = self._transfers.lock
        self.units: list[Unit] = find_units(model, config.block_modules)
        self.num_blocks = sum(u.block_index is not None for u in self.units)
        if self.num_blocks == 0:
            # No repeated blocks: the root's children take their place in forward order.
            for index, unit in enumerate(self.units):
                unit.block_index = index
            self.num_blocks = len(self.units)
        self.boundary = Boundary(self.num_blocks, config.keep_last_modules)
        self._entries: dict[tuple[int, int], Entry] = {}
        self._records: dict[tuple[int, int], Record] = {}
        self._auto_keys = itertools.count()
        self._forward = ForwardPass()
        self._depth = 0
        self._hooks_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._param_ptrs: frozenset[int] = frozenset()
        self._grad_fn_hooks: list[Any] = []
        self._hint: StageHint | None = None
        # What set_stage saw, in order (bounded): the integrations' tests compare it with the
        # schedule's own order.
        self.stage_log: collections.deque[tuple[int, int | None, str]] = collections.deque(
            maxlen=1 << 16
        )
        self._steps = Steps(config, self._transfers, self.boundary, offloader, self._on_cuda)
        self._closed = False
        self._handles: list[Any] = []
        self._install_hooks()

    # ------------------------------------------------------------------ public API
    def stats(self, cumulative: bool = False) -> CacheStats:
        """Counters of the last completed step, or totals over all steps with ``cumulative``."""
        with self._lock:
            return dataclasses.replace(self._steps.total if cumulative else self._steps.last)

    @property
    def adaptive_decision(self) -> BoundaryDecision | None:
        """The last adaptive decision (which blocks are offloaded, and the measurements it
        came from), or None before the profiled step."""
        return self.boundary.decision

    def summary(self, last: int = 20) -> str:
        """A readable table of the last ``last`` steps: bytes offloaded, forwarded,
        deduplicated and kept, GB/s, stall, peak resident, and which blocks were offloaded."""
        with self._lock:
            rows = list(self._steps.history)[-last:]
        return format_summary(rows, self.num_blocks, self.boundary.decision)

    def export_trace(self, path: str) -> int:
        """Write the last completed step's pack, store, load and stall events as Chrome-trace
        JSON (open it in Perfetto or chrome://tracing); returns the number of events."""
        return self._transfers.trace.export(path)

    def wait_for_stores(self, timeout_s: float = 60.0) -> None:
        """Block until every queued or running store has finished (for tests and debugging:
        a backward that follows sees every offloaded tensor really read back).

        Raises:
            TBAError: stores are still in flight after ``timeout_s`` seconds.
            OffloadIOError: a store failed (with ``on_io_error="raise"``).
        """
        self._transfers.wait_for_stores(timeout_s)

    def set_stage(
        self,
        *,
        microbatch: int | None,
        action: str,
        stage: int = 0,
        next_microbatch: int | None = None,
        next_action: str | None = None,
        next_stage: int | None = None,
    ) -> None:
        """Tell the cache what runs now and what comes next (called by pipeline integrations).

        Args:
            microbatch: index of the microbatch about to run.
            action: ``"forward"``, ``"backward"``, ``"input_grad"`` or ``"weight_grad"``.
            stage: pipeline stage index (several stages may share a rank).
            next_microbatch, next_action, next_stage: the action that follows, if known.

        A forward opens a record for (stage, microbatch); its last blocks stay in memory only
        when its own backward comes next. A backward prefetches that record's tensors, last
        blocks first; a known next backward is prefetched while the current action runs.
        """
        hint = StageHint(stage, microbatch, action, next_stage, next_microbatch, next_action)
        with self._lock:
            self._hint = hint
            self.stage_log.append((stage, microbatch, action))
            for key in hint.prefetch_keys:
                record = self._records.get(key)
                if record is not None and record.scopes:
                    self._prefetch_from(record.scopes[-1])

    def close(self) -> None:
        """Remove every hook tba installed and drop everything it holds. Idempotent.

        Call it after the last backward: a graph built with the cache and not yet run
        backward cannot reach offloaded tensors once the cache is closed.
        """
        if self._closed:
            return
        self._closed = True
        for handle in itertools.chain(self._handles, self._grad_fn_hooks):
            handle.remove()
        self._handles.clear()
        self._grad_fn_hooks.clear()
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._records.clear()
            self._forward.end()
        self._transfers.close(entries)
        if self.offloader is not None:
            self.offloader.close()
        from tba.integrations import registry

        registry.unregister(self)

    def __enter__(self) -> TensorCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        name = self.offloader.name if self.offloader is not None else "none"
        return (
            f"TensorCache(model={type(self.model).__name__}, offloader={name!r}, "
            f"blocks={self.num_blocks}, offloaded_blocks={self.boundary.tail_start}, closed={self._closed})"
        )

    # ------------------------------------------------------------------ module hooks
    def _install_hooks(self) -> None:
        add = self._handles.append
        add(self.model.register_forward_pre_hook(self._root_pre))
        add(self.model.register_forward_hook(self._root_post, always_call=True))
        for unit in self.units:
            add(unit.module.register_forward_pre_hook(functools.partial(self._unit_pre, unit)))
            add(
                unit.module.register_forward_hook(
                    functools.partial(self._unit_post, unit), always_call=True
                )
            )
        skip = self.config.skip_modules
        for name, module in self.model.named_modules():
            if name and matches(module, name, skip):
                add(module.register_forward_pre_hook(self._skip_pre))
                add(module.register_forward_hook(self._skip_post, always_call=True))

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if compat.in_backward() or not torch.is_grad_enabled():
            return
        self._depth += 1
        if self._depth > 1:
            return
        self._transfers.raise_pending()
        self._param_ptrs = frozenset(
            compat.local_tensor(t).untyped_storage().data_ptr()
            for t in itertools.chain(self.model.parameters(), self.model.buffers())
        )
        with self._lock:
            self._begin_record(args)
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._hooks_ctx is None or compat.in_backward():
            return
        self._depth -= 1
        if self._depth > 0:
            return
        ctx, self._hooks_ctx = self._hooks_ctx, None
        ctx.__exit__(None, None, None)
        self._steps.end_forward()
        self._forward.end()

    def _begin_record(self, args: Any) -> None:
        hint = self._hint
        if (
            self._steps.open
            and self._steps.backward_seen
            and hint is None
            and all(r.backward_started for r in self._records.values())
        ):
            # Backward ran for everything, yet some graph is still alive (retain_graph, or a
            # graph kept by the user): the step is over all the same.
            self._finish_step()
        self._steps.begin_forward(args)
        if hint is not None and hint.action == "forward":
            key, keep_tail = hint.record_key, hint.keeps_tail
        else:
            key, keep_tail = (-1, next(self._auto_keys)), True
        self._records[key] = record = Record(key, keep_tail)
        self._forward.begin(record)

    def _unit_pre(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if self._hooks_ctx is None or compat.in_backward():
            return
        self._forward.enter(unit, self.boundary.tail_start)
        if self._steps.profile is not None and unit.block_index is not None:
            self._steps.profile.start(unit.block_index)

    def _unit_post(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self._hooks_ctx is None or compat.in_backward():
            return
        scope = self._forward.exit()
        if self._steps.profile is not None and unit.block_index is not None:
            self._steps.profile.end(unit.block_index)
        if scope is None or self._closed:
            return
        seen: set[int] = set()
        for tensor in tensors_in(output):
            fn = tensor.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                hook = fn.register_prehook(functools.partial(self._backward_signal, scope))
                self._grad_fn_hooks.append(hook)

    def _skip_pre(self, module: nn.Module, args: Any) -> None:
        if self._hooks_ctx is not None and not compat.in_backward():
            self._forward.skip_depth += 1

    def _skip_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._hooks_ctx is not None and not compat.in_backward() and self._forward.skip_depth:
            self._forward.skip_depth -= 1

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._transfers.error is not None:
            self._transfers.raise_pending()
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
            return self._pack_subclass(tensor)
        if (
            tensor.device.type not in self._devices
            or type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or (tensor.requires_grad and tensor.is_leaf)
            or _views_a_parameter(tensor)
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return tensor  # parameters, subclasses, non-strided tensors: autograd keeps them
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._param_ptrs:
            return tensor
        stamp = getattr(storage, compat.STAMP_ATTR, None)
        if stamp is None:
            stamp = next(_STAMPS)
            setattr(storage, compat.STAMP_ATTR, stamp)
        key = (stamp, tensor._version)
        scope = self._forward.scope()
        transfers = self._transfers
        with self._lock:
            transfers.step.num_packed += 1
            entry = self._entries.get(key)
            if entry is None:
                nbytes = storage.nbytes()
                offload = (
                    transfers.offloader is not None
                    and not scope.keep
                    and self._forward.skip_depth == 0
                    and nbytes >= self.config.min_offload_bytes
                )
                entry = self._entries[key] = Entry(key, storage, offload)
                profile = self._steps.profile
                if profile is not None and scope.unit is not None:
                    block = scope.unit.block_index
                    if block is not None and nbytes >= self.config.min_offload_bytes:
                        profile.add_bytes(block, nbytes)
                if offload:
                    entry.event = transfers.streams.producer_event(tensor.device)
                transfers.add(entry)
            else:
                transfers.step.num_deduplicated += 1
                if scope.keep and entry.offload:
                    transfers.keep(entry, storage)
            entry.refs += 1
            if not scope.entries or scope.entries[-1] is not entry:
                scope.entries.append(entry)
        return Handle(self, entry, tensor, scope)

    def _pack_subclass(self, tensor: torch.Tensor) -> Any:
        """A wrapper subclass (DTensor, ...): pack the plain tensors it holds, rebuild it on
        unpack through the subclass's own flatten/unflatten protocol."""
        if tensor.requires_grad and tensor.is_leaf:
            return tensor  # a parameter
        names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {}
        for name in names:
            value = getattr(tensor, name)
            inner[name] = self._pack(value) if isinstance(value, torch.Tensor) else value
        if not any(isinstance(p, (Handle, _PackedSubclass)) for p in inner.values()):
            return tensor
        return _PackedSubclass(type(tensor), inner, context, tensor.size(), tensor.stride())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _PackedSubclass):
            inner = {name: self._unpack(p) for name, p in packed.inner.items()}
            return packed.cls.__tensor_unflatten__(inner, packed.context, packed.size, packed.stride)
        if not isinstance(packed, Handle):
            return packed
        if self._transfers.error is not None:
            self._transfers.raise_pending()
        if self._closed:
            raise TBAError(
                "tba: backward reached an activation after TensorCache.close(); "
                "close the cache only after the last backward"
            )
        scope = packed.scope
        if not scope.backward_entered:
            self._backward_signal(scope)
        storage, event = self._transfers.fetch(packed.entry)
        tensor = compat.view_on_storage(
            storage, packed.dtype, packed.size, packed.stride, packed.offset
        )
        if event is not None:
            self._transfers.streams.consume(event, tensor)
        return tensor

    # ------------------------------------------------------------------ backward and steps
    def _backward_signal(self, scope: Scope, *unused: Any) -> None:
        if self._closed or scope.backward_entered:
            return
        with self._lock:
            scope.backward_entered = True
            scope.record.backward_started = True
            self._steps.backward_seen = True
            self._prefetch_from(scope)

    def _prefetch_from(self, scope: Scope) -> None:
        """Load ``scope``'s tensors and those of the ``prefetch_modules`` offloaded scopes
        before it (the order backward will need them)."""
        if self.offloader is None:
            return
        budget = self.config.prefetch_modules
        scopes = scope.record.scopes
        for index in range(scope.index, -1, -1):
            current = scopes[index]
            if index != scope.index:
                if current.keep:
                    continue
                if budget == 0:
                    break
                budget -= 1
            for entry in current.entries:
                self._transfers.prefetch(entry)

    def _release(self, entry: Entry) -> None:
        if self._closed:
            return
        with self._lock:
            entry.refs -= 1
            if entry.refs:
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            self._transfers.drop(entry)
            # The step is over when everything it saved is released: after backward, or
            # because a graph died without one (forward-only with grad enabled).
            if (
                not self._entries
                and self._steps.open
                and (self._steps.backward_seen or self._hooks_ctx is None)
                and (self._hint is None or self._hint.next_action is None)
            ):
                self._finish_step()

    def _finish_step(self) -> None:
        self._steps.finish()
        self._records.clear()
        self._grad_fn_hooks.clear()  # their graphs are gone; a live one only finds a no-op

    def _on_cuda(self) -> bool:
        param = next(self.model.parameters(), None)
        return param is not None and param.device.type == "cuda"


def _views_a_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a leaf that requires grad (``weight.t()``).

    # Note [Parameters are never offloaded]
    A parameter's bytes are held by its module anyway: storing them saves nothing and reads a
    storage its owner may free. FSDP2 all-gathers each block's parameters into fresh storages
    inside the forward, after ``_root_pre`` took ``_param_ptrs``, and with
    ``reshard_after_forward=True`` frees them (``storage.resize_(0)``) after the block while a
    queued store could still be reading them. Autograd saves a parameter itself (a leaf, kept
    by the check before this one) or a view of it (``linear`` saves ``weight.t()``), whose
    ``_base`` is the parameter. ``_param_ptrs`` still covers DTensor shards and buffers.
    Tested by tests/integrations/test_fsdp.py.
    """
    base = tensor._base
    return base is not None and base.requires_grad and base.is_leaf


@dataclasses.dataclass(frozen=True)
class _PackedSubclass:
    """What autograd keeps for a wrapper-subclass tensor: its packed inner tensors."""

    cls: type
    inner: dict[str, Any]
    context: Any
    size: torch.Size
    stride: tuple[int, ...]
