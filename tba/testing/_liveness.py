"""`StorageWatch`: which storages of a forward are still alive, told by the storages themselves.

A cache's own count (``stats().peak_resident_bytes``, the engine's resident bytes) says what
tba believes it holds. Whether memory really came free is a different question: a stray
strong reference (in an entry, a worker, a closure) keeps a storage alive while the count
reads low. :class:`StorageWatch` answers it from outside tba: a ``weakref.finalize`` on each
watched storage (torch keeps one Python object per live storage, so the finalizer runs when
the storage itself is freed, not when a tensor or a storage object of Python dies).

What to watch:

- :meth:`StorageWatch.outputs_of`: the outputs of some modules (forward hooks), e.g. a tensor
  each block saves for its own backward and nothing else does;
- :meth:`StorageWatch.saved_tensors`: every tensor autograd saves while the block runs
  (outermost saved-tensor hooks; under tba's hooks they see what the model saves, but
  tba's own hooks are entered by the model's forward and stand above them);
- :meth:`StorageWatch.observe`: for ``tba.compile.watch``, every tensor a graph compiled with
  ``backend="tba"`` stores.

Example:
    >>> import torch
    >>> watch = StorageWatch()
    >>> x = torch.randn(4, requires_grad=True)
    >>> with watch.saved_tensors():
    ...     z = (x * 3).sin()  # sin saves x * 3, whose storage only autograd holds
    >>> watch.num_watched, watch.num_alive
    (1, 1)
    >>> z.sum().backward(); del z
    >>> watch.num_alive
    0
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["StorageWatch"]


class StorageWatch:
    """Finalizers on storages: how many of those watched (since the last :meth:`clear`) are
    alive now, with their names and bytes. Thread-safe (storages die on any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._alive: dict[int, tuple[str, int]] = {}  # key -> (name, bytes)
        self._storages: dict[int, int] = {}  # id(storage) -> key, while alive
        self._generation = 0
        self.num_watched = 0

    # ------------------------------------------------------------------ watching
    def watch(self, tensor: torch.Tensor, name: str = "") -> bool:
        """Watch ``tensor``'s storage (once, however many tensors view it); False for a
        tensor without a storage of its own (a wrapper subclass, a zero-byte storage)."""
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return False
        num_bytes = storage.nbytes()
        if num_bytes == 0:
            return False
        with self._lock:
            if id(storage) in self._storages:
                return False
            key = next(self._keys)
            self._storages[id(storage)] = key
            self._alive[key] = (name or f"storage {key}", num_bytes)
            self.num_watched += 1
            generation = self._generation
        weakref.finalize(storage, self._freed, id(storage), key, generation)
        return True

    def observe(self, tensor: torch.Tensor, kind: str) -> None:
        """``tba.compile.watch``'s observer: watch every tensor a compiled graph stores
        (``kind == "saved"``); reloads are not watched."""
        if kind == "saved":
            self.watch(tensor, f"stored {self.num_watched}")

    @contextlib.contextmanager
    def outputs_of(self, modules: Mapping[str, torch.nn.Module]) -> Iterator[StorageWatch]:
        """Watch the output of each of ``modules`` (name -> module) while the block runs."""

        def hook_of(name: str) -> Any:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                if isinstance(output, torch.Tensor):
                    self.watch(output, name)
            return hook

        handles = [m.register_forward_hook(hook_of(name)) for name, m in modules.items()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def saved_tensors(self) -> Iterator[StorageWatch]:
        """Watch every tensor autograd saves while the block runs (saved-tensor hooks that
        hand the tensor on unchanged; parameters and views of them aside)."""

        def pack(x: torch.Tensor) -> torch.Tensor:
            base = x._base
            if not (x.requires_grad and x.is_leaf) and not (base is not None and base.requires_grad and base.is_leaf):
                self.watch(x, f"saved {self.num_watched}")
            return x.detach() if x.requires_grad else x  # no output -> grad_fn -> output cycle

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            yield self

    # ------------------------------------------------------------------ reading
    @property
    def alive(self) -> list[str]:
        """The names of the watched storages still alive, in the order they were watched."""
        with self._lock:
            return [name for _, (name, _) in sorted(self._alive.items())]

    @property
    def num_alive(self) -> int:
        with self._lock:
            return len(self._alive)

    @property
    def alive_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._alive.values())

    def clear(self) -> None:
        """Forget everything watched so far (their finalizers then do nothing)."""
        with self._lock:
            self._generation += 1
            self._alive.clear()
            self._storages.clear()
            self.num_watched = 0

    def _freed(self, storage_id: int, key: int, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self._alive.pop(key, None)
            if self._storages.get(storage_id) == key:
                del self._storages[storage_id]

    def __repr__(self) -> str:
        return f"StorageWatch({self.num_alive} of {self.num_watched} alive, {self.alive_bytes} bytes)"
