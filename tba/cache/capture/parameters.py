"""`ParameterStorages`: the storages of the configured model's parameters and buffers, found by
one walk over the model and reused for as long as nothing about them changed.

Note [Parameter storages, checked not rebuilt]: the pack hook leaves to autograd every save on
the storage of one of the model's parameters or buffers (Note [Parameters are never offloaded]
in saving.py); it needs their storage addresses at each forward. Walking the module tree and
asking every tensor for its storage costs about as much as a step of a small model spends in
tba otherwise, so the addresses are kept, with a snapshot of what they were computed from:
  - every module of the tree (weakly: the cache must not keep the model alive, Note [The model
    owns its cache] in tba/cache/tensor_cache.py), and the identity (``id``) and number of the
    values of each module's ``_modules``, ``_parameters`` and ``_buffers``;
  - each plain parameter's and buffer's data address (``data_ptr``; a DTensor's: its local
    shard's).
Each forward compares the model against the snapshot with C-level maps (no Python call per
parameter) and walks the model again only when something differs. What each check catches:
  - a submodule, parameter or buffer assigned, registered, deleted or swapped in a module's
    dicts (``module.weight = ...``, ``load_state_dict(assign=True)``, ``Module.to()`` replacing
    buffers, ``torch.func.functional_call``'s stand-ins): the identities or the numbers;
  - a storage moved under the same tensor object (``param.data = ...``, ``Module.to()``,
    ``torch.utils.swap_tensors``, FSDP freeing and regrowing a storage with ``resize_``): the
    data addresses;
  - a module collected: its weak reference.
An ``id`` is reused only after its object died, and a replacement is made while the old object
is still in the dict, so a changed value never shows its predecessor's ``id``; and the
addresses are read from the current tensors, so the set is right whenever the check passes. Not
seen: a module's ``_parameters`` dict itself replaced by another dict object (no torch code
path does this). Tested in tests/cache/test_parameter_storages.py.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tba import _torch_compat as compat

__all__ = ["ParameterStorages"]

_TENSOR = torch.Tensor
_data_ptr = torch.Tensor.data_ptr
_call = weakref.ref.__call__  # C-level: operator.call is Python >= 3.11
_children = operator.attrgetter("_modules")
_parameters = operator.attrgetter("_parameters")
_buffers = operator.attrgetter("_buffers")
_values = dict.values


class ParameterStorages:
    """Storage addresses of a model's parameters and buffers (``current``), rebuilt only when
    the model changed (Note [Parameter storages, checked not rebuilt])."""

    def __init__(self) -> None:
        self.ptrs: frozenset[int] = frozenset()
        self.num_rebuilds = 0  # walks over the model (for tests)
        self._model: weakref.ref[nn.Module] | None = None
        # Modules with submodules: their ``_modules`` are read through these weak references.
        self._parents: list[weakref.ref[nn.Module]] = []
        # Every other dict of the snapshot, held (no module is kept alive: parameter and buffer
        # dicts hold tensors; the ``_modules`` of a module without submodules holds nothing):
        # those that were empty (a value added to one shows as a length) ...
        self._empty: list[dict[str, Any]] = []
        # ... and the parameter and buffer dicts that were not.
        self._full: list[dict[str, Any]] = []
        self._ids: list[int] = []  # of the values of the parents' ``_modules``, then of ``_full``
        self._pick: Callable[[list[Any]], Any] | None = None  # the plain tensors among the values
        self._plain_ptrs: list[int] = []
        self._others: list[tuple[int, int]] = []  # (position, data address) of subclass tensors

    def current(self, model: nn.Module) -> frozenset[int]:
        """The storage addresses of ``model``'s parameters and buffers now."""
        if not self._unchanged(model):
            self._rebuild(model)
        return self.ptrs

    def _unchanged(self, model: nn.Module) -> bool:
        if self._model is None or self._model() is not model or any(map(len, self._empty)):
            return False
        try:
            dicts = [*map(_children, map(_call, self._parents)), *self._full]
        except AttributeError:  # a module was collected (its reference gives None)
            return False
        values = list(itertools.chain.from_iterable(map(_values, dicts)))
        if list(map(id, values)) != self._ids:
            return False
        pick = self._pick
        if pick is not None and list(map(_data_ptr, pick(values))) != self._plain_ptrs:
            return False
        return all(_address(values[i]) == ptr for i, ptr in self._others)

    def _rebuild(self, model: nn.Module) -> None:
        self.num_rebuilds += 1
        modules = list(model.modules())
        parents = [m for m in modules if m._modules]
        tensor_dicts = [*map(_parameters, modules), *map(_buffers, modules)]
        full = [d for d in tensor_dicts if d]
        empty = [d for d in tensor_dicts if not d] + [m._modules for m in modules if not m._modules]
        values = list(itertools.chain.from_iterable(map(_values, [*map(_children, parents), *full])))
        plain: list[int] = []
        others: list[tuple[int, int]] = []
        ptrs: set[int] = set()
        for position, value in enumerate(values):
            if not isinstance(value, _TENSOR) or compat.is_functorch_wrapped(value):
                continue  # modules, None, and torch.func.functional_call's stand-ins
            local = compat.local_tensor(value)
            ptrs.add(local.untyped_storage().data_ptr())
            if local is value and (type(value) is _TENSOR or type(value) is nn.Parameter):
                plain.append(position)
            else:
                others.append((position, _address(value)))
        self._model = weakref.ref(model)
        self._parents = [weakref.ref(m) for m in parents]
        self._empty, self._full = empty, full
        self._ids = list(map(id, values))
        self._pick = _picker(plain)
        self._plain_ptrs = [values[i].data_ptr() for i in plain]
        self._others = others
        self.ptrs = frozenset(ptrs)


def _address(tensor: torch.Tensor) -> int:
    """The data address of a parameter that is not a plain tensor (a DTensor: its shard's)."""
    return compat.local_tensor(tensor).data_ptr()


def _picker(positions: list[int]) -> Callable[[list[Any]], Any] | None:
    """A C-level function taking the items at ``positions`` of a list, as a sequence."""
    if not positions:
        return None
    if len(positions) == 1:
        position = positions[0]
        return lambda values: (values[position],)
    return operator.itemgetter(*positions)
