"""What tba's ops do when a compiled graph runs: hand tensors to the cache and take them back.

Note [Keys and shape carriers]: a store returns, per group, a *key* (a one-byte tensor whose
storage carries, as a Python attribute, what ``SavedTensors.pack`` returned for each member:
the handles autograd would have kept) and, per member, a *shape carrier*: a zero-element
tensor of the member's dtype and device whose sizes are ``(0, *size, *stride)`` (the
offset is the storage's business: a compiled graph reads a tensor from its data pointer) and
whose strides are all zero. The zero strides are a rule: those dims multiply past 2**63 for
ordinary activations (GPT-2 at hidden 2048, batch 32: the MLP's ``(32, 1024, 8192)`` with
its strides is 2**64), and contiguous strides, the product of the dims to the right, then overflow
(``torch.empty`` raised "Stride calculation overflowed" in the fake implementation while the
backend compiled); the element count is zero either way. Both are saved for backward instead of the member. The key's storage is its identity: the
runtime wrappers may hand backward a view or a detached alias of it (AOTAutograd restrides
outputs and detaches views before ``save_for_backward``), which all share the storage, and
the handles die with the last of them, when backward no longer needs the key, as autograd's
saved tensors do. The carrier only describes: Inductor may replace a zero-element output by
a fresh empty tensor of the same shape (it does), and the reload's fake implementation and
the backward graph's dynamic sizes need nothing but that shape (symbols of a dynamic shape are
bound from it in backward, where the member itself no longer arrives). Tested by
tests/compile/test_compile_offload.py (dynamic shapes, Inductor, dims past 2**63).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tba import _env
from tba import _torch_compat as compat
from tba.cache.capture.compiled import CompiledForwards
from tba.cache.engine import Entry, Handle
from tba.cache.tensor_cache import TensorCache
from tba.errors import TBAError
from tba.integrations import registry

__all__ = [
    "GraphInfo", "register_graph", "store", "reload", "prefetch", "watch", "carrier",
    "geometry", "KEY_ATTR",
]

KEY_ATTR = "_tba_packed"

#: Called with each tensor a store takes ("saved") and each tensor a reload returns
#: ("reloaded"), for measurements (``watch``).
Observer = Callable[[torch.Tensor, str], None]
_observers: list[Observer] = []


@dataclasses.dataclass(frozen=True)
class GraphInfo:
    """What a compiled forward graph's stores need at run time.

    Attributes:
        model: the configured model it was compiled for (weakly).
        fingerprint: the cache options the graph's plan depends on.
    """

    model: weakref.ref[nn.Module]
    fingerprint: tuple[object, ...]


_graphs: dict[int, GraphInfo] = {}
_graph_ids = itertools.count()

# Note [Whose graph is it]: Dynamo hands a module's parameters to its graph as inputs, so one
# compiled graph serves every instance of the model's class (and every block of a model whose
# own graph breaks make Dynamo compile a block's frame): the model a graph was compiled for is
# not the one it runs for. The first store of a run finds the cache from its marker parameter
# (Note [Units at run time] in plan.py), the model it belongs to; a graph without parameter
# inputs uses the model it was compiled for. Markers are parameters of the configured model, so
# a marker no cache owns belongs to an instance of the model's class that was not configured:
# refused, never saved into the other model's cache. Tested by tests/compile/test_backend.py
# (two models, one graph; one of them without a cache).


def fingerprint(cache: TensorCache) -> tuple[object, ...]:
    """The options a graph's plan was made with (which values, which units)."""
    config = cache.config
    return (tuple(sorted(config.offload_devices)), config.skip_modules, config.block_modules,
            config.min_offload_bytes)


def register_graph(model: nn.Module, cache: TensorCache) -> int:
    """An id for a rewritten forward graph, baked into its store ops."""
    graph_id = next(_graph_ids)
    _graphs[graph_id] = GraphInfo(weakref.ref(model), fingerprint(cache))
    return graph_id


# Parameter and buffer data pointers of the configured models -> their cache (weakly):
# Note [Whose graph is it].
_owners: dict[int, weakref.ref[TensorCache]] = {}


def _owner(marker: torch.Tensor) -> TensorCache | None:
    ref = _owners.get(marker.data_ptr())
    cache = ref() if ref is not None else None
    if cache is None or cache.closed:
        _owners.clear()
        for module, found in registry.registered():
            if isinstance(found, TensorCache) and not found.closed:
                for tensor in itertools.chain(module.parameters(), module.buffers()):
                    _owners[tensor.data_ptr()] = weakref.ref(found)
        ref = _owners.get(marker.data_ptr())
        cache = ref() if ref is not None else None
    return cache


def _holds(model: nn.Module | None, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` shares storage with a parameter or buffer of ``model``."""
    if model is None:
        return False
    ptr = tensor.data_ptr()
    return any(t.data_ptr() == ptr for t in itertools.chain(model.parameters(), model.buffers()))


def _seam(graph_id: int, marker: torch.Tensor | None) -> CompiledForwards:
    """The cache of the model the graph runs for now (Note [Whose graph is it]; configuring
    again after compiling works when the plan's options are unchanged)."""
    info = _graphs[graph_id]
    cache = _owner(marker) if marker is not None else None
    model = info.model()
    if cache is None and marker is not None and not _holds(model, marker):
        # Markers are parameters of the configured model (plan.py): this one's module is
        # another instance of its class, which shares the graph but has no cache.
        raise TBAError(
            "tba: a graph compiled with backend=\"tba\" for a model with a tensor cache ran for "
            "another instance of its class that has none (Dynamo shares one graph among "
            "instances); configure that model too (tba.configure_tensor_cache), or compile it "
            "with another backend"
        )
    if cache is None:
        found = registry.get(model) if model is not None else None
        cache = found if isinstance(found, TensorCache) else None
    if cache is None or cache.closed:
        raise TBAError(
            "tba: a graph compiled with backend=\"tba\" ran but its model has no open tensor "
            "cache (it was closed); configure the model again (tba.configure_tensor_cache: "
            "the compiled graph uses the new cache), or call torch.compiler.reset() and "
            "compile without tba"
        )
    if fingerprint(cache) != info.fingerprint:
        raise TBAError(
            "tba: the model was configured again with other offload_devices, skip_modules, "
            "block_modules or min_offload_bytes than the graph compiled with backend=\"tba\" "
            "was planned for; call torch.compiler.reset() after configure_tensor_cache so the "
            "model compiles again"
        )
    return cache._compiled_forwards()


class _Run(threading.local):
    """The compiled forward running on this thread."""

    def __init__(self) -> None:
        self.graph = -1
        self.next = 0
        self.seam: CompiledForwards | None = None
        self.stored: dict[int, int] | None = None  # storage stamp -> store index (invariants)


_run = _Run()


def carrier(tensor: torch.Tensor, real: bool = False) -> torch.Tensor:
    """A zero-element tensor whose shape is ``tensor``'s size and stride, with zero strides
    (Note [Keys and shape carriers]); ``real``: made for a graph that runs (never under a fake
    mode), by the allocator Inductor's own code uses."""
    dims = (0, *tensor.shape, *tensor.stride())
    if real:
        return compat.new_empty(dims, (0,) * len(dims), tensor.dtype, tensor.device)
    return torch.empty_strided(dims, (0,) * len(dims), dtype=tensor.dtype, device=tensor.device)


def geometry(shape: torch.Tensor, ndim: int) -> tuple[list[Any], list[Any]]:
    """The (size, stride) a carrier describes."""
    dims = list(shape.shape[1:])
    return dims[:ndim], dims[ndim:2 * ndim]


def store(tensors: list[torch.Tensor], index: int, graph_id: int, module: str | None,
          marker: torch.Tensor | None, marker_path: str | None, last: bool) -> list[torch.Tensor]:
    """``tba::store``: hand one group's tensors to the cache (Note [The cache under compiled
    graphs] in tba/cache/capture/compiled.py); returns its key and the members' shape carriers."""
    run = _run
    if index == 0:
        seam = _seam(graph_id, marker)
        seam.begin(tensors)
        run.graph, run.next, run.seam = graph_id, 0, seam
        run.stored = {} if _env.check_invariants() else None
    elif run.graph != graph_id or run.next != index or run.seam is None:
        raise AssertionError(
            f"tba bug: store {index} of compiled graph {graph_id} ran out of order (expected "
            f"store {run.next} of graph {run.graph})"
        )
    seam = run.seam
    assert seam is not None
    seam.enter(seam.unit_at(module, marker, marker_path))
    packed = seam.save_group(tensors)
    if run.stored is not None:
        _check_stored_once(run.stored, packed, index)
    for observer in _observers:
        for tensor in tensors:
            observer(tensor, "saved")
    key = compat.new_empty((1,), (1,), torch.uint8, tensors[0].device)
    setattr(key.untyped_storage(), KEY_ATTR, (seam.saved, packed))
    run.next = index + 1
    if last:
        run.graph, run.seam, run.stored = -1, None, None
        seam.end()
    return [key, *[carrier(tensor, real=True) for tensor in tensors]]


def _check_stored_once(stored: dict[int, int], packed: list[Any], index: int) -> None:
    """Note [What a compiled graph stores]: one store op per storage. With
    ``TBA_CHECK_INVARIANTS=1`` a storage (its stamp: Note [Storage stamps]) that an earlier
    store of the same run already took is a planning bug (an alias stored twice)."""
    for value in packed:
        if type(value) is not Handle:
            continue
        first = stored.setdefault(value.entry.stamp, index)
        if first != index:
            raise TBAError(
                f"tba invariant violated: store {index} of a compiled graph saved a storage that "
                f"store {first} already stored (an alias stored twice)"
            )


def _packed(key: torch.Tensor) -> tuple[Any, list[Any]]:
    packed = getattr(key.untyped_storage(), KEY_ATTR, None)
    if packed is None:
        raise AssertionError(
            "tba bug: a reload's key no longer carries what its store packed (Note [Keys and "
            "shape carriers])"
        )
    saved, values = packed
    return saved, values


def reload(key: torch.Tensor, shape: torch.Tensor, member: int, ndim: int) -> torch.Tensor:
    """``tba::reload``: the member back from the cache, as autograd's unpack hook would."""
    saved, values = _packed(key)
    tensor: torch.Tensor = saved.unpack(values[member])
    dims = shape.shape
    if tensor.shape != dims[1:ndim + 1] or tensor.stride() != dims[ndim + 1:]:
        size, stride = geometry(shape, ndim)
        raise AssertionError(
            f"tba bug: reload of member {member} returned size {tuple(tensor.shape)} and stride "
            f"{tensor.stride()}; its store saw size {tuple(size)} and stride {tuple(stride)}"
        )
    for observer in _observers:
        observer(tensor, "reloaded")
    return tensor


def prefetch(keys: list[torch.Tensor]) -> torch.Tensor:
    """``tba::prefetch``: start loading the groups of ``keys`` (in order)."""
    entries: list[Entry] = []
    saved = None
    for key in keys:
        saved, values = _packed(key)
        entries.extend(value.entry for value in values if type(value) is Handle)
    if saved is not None and not saved.closed:
        saved.engine.prefetch(entries)
    return torch.empty(1, dtype=torch.uint8, device=keys[0].device)


@contextlib.contextmanager
def watch(observer: Observer) -> Iterator[None]:
    """Call ``observer(tensor, kind)`` for every tensor a compiled graph's store takes
    (``kind == "saved"``) and every tensor its reloads return (``"reloaded"``) while the block
    runs: the saved-activation meter of ``benchmarks/compile_offload.py`` counts them."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)
