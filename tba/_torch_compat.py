"""Every private torch internal tba relies on, in one place.

Checked against torch 2.4 through 2.13 (CPU and CUDA builds). If a torch release changes one
of these, this module is the only place to mend.
"""

from __future__ import annotations

import torch
import torch.autograd.profiler as _autograd_profiler

__all__ = [
    "in_backward", "local_tensor", "storage_bytes", "view_on_storage", "release_alias",
    "is_functorch_wrapped", "in_functorch_transform", "profiler_enabled", "STAMP_ATTR",
    "FAMILY_ATTR",
]

# Note [Storage stamps]: torch keeps one Python object per StorageImpl alive for as long as the
# storage lives (PyObject preservation, torch >= 2.0), so an attribute set on
# `t.untyped_storage()` is seen through every view of that storage and disappears with it.
# That gives storages a collision-free identity: a raw data pointer or `id()` is reused once
# the storage dies (TBA_NOTES section 4, bugs 1 and 2). Tested in tests/cache/test_ids.py.
STAMP_ATTR = "_tba_stamp"
# The same for the root tensor of a view family (torch preserves a tensor's Python object as
# long as its TensorImpl lives): Note [Version-counter families] in tba/cache/table.py.
FAMILY_ATTR = "_tba_family"


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. while
    activation checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over every byte of ``storage`` (shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def view_on_storage(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    size: torch.Size,
    stride: tuple[int, ...],
    offset: int,
) -> torch.Tensor:
    """A tensor of ``dtype`` viewing ``storage`` with the given geometry (no copy)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s data on this rank (a DTensor's local shard)."""
    return getattr(tensor, "_local_tensor", tensor)


def release_alias(alias: torch.Tensor) -> None:
    """Point ``alias`` (a ``detach()`` alias) at an empty storage, keeping its version counter
    (shared with its view family) untouched: the family's in-place writes stay observable
    through ``alias._version`` without holding the memory (Note [Saved-version check] in
    tba/cache/table.py). ``set_`` is dispatched below the ADInplaceOrView key, which is where
    in-place ops bump the counter, so no thread ever sees a transient version change (autograd
    checks that a pack hook leaves its input's version alone)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        alias.set_(alias.new_empty(0))


def in_functorch_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, vjp, ...) is running on this thread; those
    refuse saved-tensor hooks ("don't yet support saved tensor hooks")."""
    return torch._C._functorch.maybe_current_level() is not None


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch.func (functorch) wrapper: a grad or vmap level's tensor,
    whose storage cannot be reached."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` / ``torch.autograd.profiler`` session is running: the
    module flag torch's own Python fast paths read (set on start, cleared on stop)."""
    return _autograd_profiler._is_profiler_enabled
