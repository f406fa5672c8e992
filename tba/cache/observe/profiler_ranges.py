"""tba's stores, loads and stalls as ``torch.profiler`` ranges, on the model's own timeline.

Note [Profiler ranges]: while a ``torch.profiler`` (or ``torch.autograd.profiler``) session
runs, each store and load is a ``record_function`` range on its worker thread, named
``tba::store <unit>`` / ``tba::load <unit>`` after the unit (block, or module around the
blocks) whose forward saved the tensor, and each wait of the training thread for a load is a
``tba::stall <unit>`` range on that thread. With no session running a transfer costs one read
of torch's own module flag (``_torch_compat.profiler_enabled``) and enters a shared
``nullcontext``: nothing is built or named.

PyTorch's profiler records the thread that started it (and autograd's threads): the stall
ranges show up by default, the worker threads' ranges when the profiler is asked for every
thread (``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``).
Tested by tests/cache/test_profiler_ranges.py.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch

from tba._torch_compat import profiler_enabled

__all__ = ["transfer_range", "LoadDone", "unit_name", "NamedUnit", "UnitScope", "Transferred"]

_OFF = contextlib.nullcontext()


class NamedUnit(Protocol):
    """A unit as a range names it (``tba.cache.steps.scopes.Unit``)."""

    @property
    def name(self) -> str: ...


class UnitScope(Protocol):
    """A scope as a range names it (``tba.cache.steps.scopes.Scope``): the unit whose forward
    saved into it, None for tensors saved outside every unit."""

    @property
    def unit(self) -> NamedUnit | None: ...


class Transferred(Protocol):
    """What a range needs of a stored or loaded entry (``tba.cache.engine.entries.Entry``)."""

    @property
    def scope(self) -> UnitScope: ...

    @property
    def nbytes(self) -> int: ...


def unit_name(scope: UnitScope | None) -> str:
    """The name of the unit whose forward saved into ``scope`` (the model itself for tensors
    saved outside every unit)."""
    unit = getattr(scope, "unit", None)
    return (unit.name if unit is not None else "") or "model"  # "": the model as its one unit


def transfer_range(kind: str, entry: Transferred) -> contextlib.AbstractContextManager[object]:
    """A ``tba::<kind> <unit>`` range around a transfer of ``entry`` while a profiler runs."""
    if not profiler_enabled():
        return _OFF
    return torch.profiler.record_function(
        f"tba::{kind} {unit_name(entry.scope)}", f"{entry.nbytes} bytes"
    )


class LoadDone(threading.Event):
    """Set when a load finished. Waiting for it is a stall of the training thread, shown as a
    ``tba::stall <unit>`` range while a profiler runs."""

    def __init__(self, scope: UnitScope | None) -> None:
        super().__init__()
        self._unit = getattr(scope, "unit", None)  # not the scope: it holds the entries

    def wait(self, timeout: float | None = None) -> bool:
        if not profiler_enabled():
            return super().wait(timeout)
        name = (self._unit.name if self._unit is not None else "") or "model"
        with torch.profiler.record_function(f"tba::stall {name}"):
            return super().wait(timeout)
