"""Which tensor cache serves which module, so a patched scheduler can find it.

``tba.configure_tensor_cache`` calls :func:`register` for the module it hooks, and
``TensorCache.close`` calls :func:`unregister`. A patched pipeline scheduler only knows the
module it is about to run (a pipeline stage's ``submod``, a Megatron model chunk, a DeepSpeed
``PipelineModule``), so :func:`lookup` accepts that module, a wrapper around the registered
module (DDP, Float16Module, ...), or a submodule of it.

The registry is per process and holds weak references to modules and caches: it never keeps
a model or a cache alive (a cache dropped without ``close()`` is collected with its model). It is the only state the integrations share besides their patch records.

Example:
    >>> from tba.integrations import registry
    >>> registry.register(cache, stage_module)  # done by configure_tensor_cache
    >>> registry.lookup(stage_module) is cache
    True
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

import torch

__all__ = ["CacheLike", "register", "unregister", "lookup", "registered", "get"]


class CacheLike(Protocol):
    """What the registry and the integrations need from a tensor cache.

    ``tba.TensorCache`` satisfies it; so does any object with these two methods (the tests'
    recording fakes).
    """

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
        """What runs now (``stage``, ``microbatch``, ``action``) and what runs next, if known."""
        ...

    def close(self) -> None:
        """End the cache (``tba.configure_tensor_cache`` closes a module's previous cache)."""
        ...


_lock = threading.Lock()
# module -> weak reference to its cache; weak on both sides: the cache holds its module, so a
# strong value would keep the key alive forever.
_refs: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[CacheLike]] = weakref.WeakKeyDictionary()
# Memo of lookup() answers for modules that are not registered themselves (None: no cache);
# cleared on change.
_memo: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[CacheLike] | None] = (
    weakref.WeakKeyDictionary()
)


def register(cache: CacheLike, module: torch.nn.Module) -> None:
    """Record that ``cache`` holds the activations of ``module`` (and its submodules).

    Raises:
        ValueError: ``module`` already has a different cache; close that one first.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register() expects a torch.nn.Module, got {type(module).__name__}")
    with _lock:
        current = _get(module)
        if current is not None and current is not cache:
            raise ValueError(
                f"{type(module).__name__} already has a tensor cache registered; close it "
                "(cache.close()) before configuring another one for the same module"
            )
        _refs[module] = weakref.ref(cache)
        _memo.clear()


def get(module: torch.nn.Module) -> CacheLike | None:
    """The cache registered for ``module`` itself, or None."""
    with _lock:
        return _get(module)


def _get(module: torch.nn.Module) -> CacheLike | None:
    ref = _refs.get(module)
    return None if ref is None else ref()


def _items() -> list[tuple[torch.nn.Module, CacheLike]]:
    out = []
    for module, ref in list(_refs.items()):
        cache = ref()
        if cache is not None:
            out.append((module, cache))
    return out


def unregister(cache_or_module: CacheLike | torch.nn.Module) -> None:
    """Forget a cache (every module it was registered for) or one module. Idempotent."""
    with _lock:
        if isinstance(cache_or_module, torch.nn.Module):
            _refs.pop(cache_or_module, None)
        else:
            for module in [m for m, c in _items() if c is cache_or_module]:
                del _refs[module]
        _memo.clear()


def lookup(module: torch.nn.Module) -> CacheLike | None:
    """The cache serving ``module``, or ``None``.

    Tried in order: ``module`` itself; a registered module inside ``module`` (``module`` wraps
    it: DDP, Float16Module, a pipeline stage container); a registered module that contains
    ``module``. When several match, the first registered wins.
    """
    with _lock:
        found = _get(module)
        if found is not None:
            return found
        if module in _memo:
            ref = _memo[module]
            return None if ref is None else ref()
        items = _items()
        inner = {id(m) for m in module.modules()}
        for registered_module, cache in items:
            if id(registered_module) in inner:
                found = cache
                break
        if found is None:
            for registered_module, cache in items:
                if any(m is module for m in registered_module.modules()):
                    found = cache
                    break
        _memo[module] = None if found is None else weakref.ref(found)
        return found


def registered() -> list[tuple[torch.nn.Module, CacheLike]]:
    """Every (module, cache) pair currently registered, for debugging and tests."""
    with _lock:
        return _items()
