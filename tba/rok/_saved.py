"""Bytes of saved activations held on the training device, counted without tba's cache (private
module of :mod:`tba.rok`).

# Note [One measure of activation memory]
The ROK curve's x-axis is one quantity for every strategy: the peak, during a training step,
of the bytes of saved activations (the tensors autograd keeps for backward) held in the
training device's memory. Parameters, buffers and views of them are not activations and are
never counted; each storage counts once, however many tensors view it.

  * tba strategies (offload-host, offload-ssd, adaptive, budget): the cache's own count,
    ``stats().peak_resident_bytes``, which sees every saved tensor and knows which ones it
    moved out (an entry counts from its save until its store finished, and again from its
    reload until backward is done with it).
  * keep (plain PyTorch) and the checkpointing strategies (recompute, recompute+offload):
    :class:`SavedActivationMeter` on one extra step after warm-up. Activation checkpointing
    hides what it saves from any outer hook: inside a checkpointed block its own hooks stand
    above tba's, and the tensors its recomputation saves in backward (one block's worth, alive
    until backward has used them) pass through checkpoint's recomputation hook only. So the
    meter pushes its hook above whatever hook is active (tba's in the model's forward,
    checkpoint's during recomputation: ``context_fn``) and passes every tensor on to it.

The meter counts a storage from the moment it is saved (or recomputed, or handed back by an
inner hook's unpack: a reload) until the storage is freed (``weakref.finalize`` on the storage:
torch keeps one Python object per live storage). With nothing below it, a storage lives as long
as autograd holds it, so for keep the meter and tba's ``offloader="none"`` count agree exactly
at the peak; with tba below, a storage tba offloaded dies when its store finished, as in the
cache's count. Tested in tests/benchmarks/test_rok_accounting.py.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tba import _torch_compat as compat

__all__ = ["KINDS", "SavedActivationMeter"]

# How a counted storage reached the meter: saved in forward (or by checkpoint for its block
# inputs), saved again by a checkpointed block's recomputation in backward, or handed back by
# an inner hook's unpack (an offloaded tensor read back).
KINDS = ("saved", "recomputed", "reloaded")


class SavedActivationMeter:
    """Counts bytes of distinct storages saved for backward on ``device_type`` while they live.

    Args:
        model: its parameters and buffers are never counted.
        device_type: the training device (``"cpu"`` or ``"cuda"``).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> meter = SavedActivationMeter(model, "cpu")
        >>> with meter.measuring():
        ...     model(torch.randn(3, 4)).sum().backward()
        >>> meter.peak_bytes  # the input (3x4) and ReLU's output (3x8), float32
        144
    """

    def __init__(self, model: torch.nn.Module, device_type: str) -> None:
        self._model = model
        self._device_type = device_type
        self._lock = threading.Lock()
        self._generation = itertools.count()
        self._current = -1  # the generation being measured (-1: not measuring)
        self._live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, kind)
        self._excluded: frozenset[int] = frozenset()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_storages = 0
        self._by_kind = dict.fromkeys(KINDS, 0)
        self.peak_by_kind = dict.fromkeys(KINDS, 0)  # what the live bytes were at the peak

    # ------------------------------------------------------------------------ public
    @contextlib.contextmanager
    def measuring(self) -> Iterator[SavedActivationMeter]:
        """Count from zero while the block runs (one training step): every forward of the
        model and every recomputation of a checkpointed block (given :meth:`checkpoint_contexts`
        as its ``context_fn``)."""
        self._excluded = frozenset(
            t.untyped_storage().data_ptr() for t in itertools.chain(self._model.parameters(), self._model.buffers())
        )
        with self._lock:
            self._current = next(self._generation)
            self._live.clear()
            self.live_bytes = self.peak_bytes = self.num_storages = 0
            self._by_kind = dict.fromkeys(KINDS, 0)
            self.peak_by_kind = dict.fromkeys(KINDS, 0)
        entered: list[contextlib.AbstractContextManager[Any]] = []

        def pre(module: torch.nn.Module, args: Any) -> None:
            ctx = self._hooks("saved")
            ctx.__enter__()
            entered.append(ctx)

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if entered:
                entered.pop().__exit__(None, None, None)

        # Under torch.compile the model's own hooks run eagerly around its compiled forward,
        # and Dynamo would compile their frames: keep it out of them (as of tba's own hooks).
        compat.keep_dynamo_out(pre, post)
        # Registered after any cache's hooks, so the meter's saved-tensor hooks stand above
        # the cache's in every forward (pushed after them, popped before them).
        handles = [self._model.register_forward_pre_hook(pre),
                   self._model.register_forward_hook(post, prepend=True, always_call=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            while entered:
                entered.pop().__exit__(None, None, None)
            with self._lock:
                self._current = -1
                self._live.clear()

    def observe(self, tensor: torch.Tensor, kind: str) -> None:
        """Count ``tensor`` (saved, recomputed or reloaded: ``KINDS``) while measuring, as
        the meter's own hooks would; for saves that reach no saved-tensor hook (the stores and
        reloads inside a graph compiled with ``backend="tba"``: ``tba.compile.watch``)."""
        self._track(tensor, kind)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager[Any], ...]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: while measuring, counts what
        a checkpointed block saves when backward recomputes it; otherwise does nothing."""
        if self._current < 0:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), self._hooks("recomputed")

    # ------------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _hooks(self, kind: str) -> Iterator[None]:
        """Saved-tensor hooks that count, then hand the tensor to the hooks that were active
        when this context was entered (found then: checkpoint makes its recompute context in
        forward and enters it in backward, above its recomputation hook)."""
        below = compat.top_saved_tensors_hooks()
        track = self._track
        if below is None:
            def pack(x: torch.Tensor) -> Any:
                track(x, kind)
                return x.detach() if x.requires_grad else x  # no output -> grad_fn -> output cycle

            def unpack(packed: Any) -> Any:
                return packed
        else:
            inner_pack: Callable[[torch.Tensor], Any] = below[0]
            inner_unpack: Callable[[Any], Any] = below[1]

            def pack(x: torch.Tensor) -> Any:
                track(x, kind)  # first: checkpoint's recomputation hook may raise to stop early
                return inner_pack(x)

            def unpack(packed: Any) -> Any:
                tensor = inner_unpack(packed)
                if isinstance(tensor, torch.Tensor):
                    track(tensor, "reloaded")  # a storage seen before is not counted again
                return tensor
        compat.keep_dynamo_out(pack, unpack, self._track, self._freed)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _track(self, tensor: torch.Tensor, kind: str) -> None:
        if tensor.device.type != self._device_type or tensor.layout is not torch.strided:
            return
        if tensor.requires_grad and tensor.is_leaf:
            return  # a parameter
        base = tensor._base
        if base is not None and base.requires_grad and base.is_leaf:
            return  # a view of a parameter
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:  # a wrapper without storage (torch.func)
            return
        num_bytes = storage.nbytes()
        if num_bytes == 0 or storage.data_ptr() in self._excluded:
            return
        key = id(storage)  # unique while the storage lives; forgotten when it dies
        with self._lock:
            generation = self._current
            if generation < 0 or key in self._live:
                return
            self._live[key] = (num_bytes, kind)
            self.num_storages += 1
            self.live_bytes += num_bytes
            self._by_kind[kind] += num_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_by_kind = dict(self._by_kind)
        weakref.finalize(storage, self._freed, key, generation)

    def _freed(self, key: int, generation: int) -> None:
        with self._lock:
            if generation != self._current:
                return
            entry = self._live.pop(key, None)
            if entry is None:
                return
            self.live_bytes -= entry[0]
            self._by_kind[entry[1]] -= entry[0]
