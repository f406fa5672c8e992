"""`ModuleHook`: a module hook that belongs to one cache, and what it becomes in copies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tba import _torch_compat as compat

__all__ = ["ModuleHook", "inert_hook"]


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a tba hook becomes in a copy of the model: nothing."""
    return None


def _make_inert() -> Callable[..., None]:
    return inert_hook


class ModuleHook:
    """A module hook that belongs to one cache. A copy of the model (``copy.deepcopy``,
    ``torch.save``/``pickle``) gets an inert hook instead: the copy behaves like a model that
    was never configured, and the original keeps its cache.

    Traced by Dynamo (its module runs inside compiled code), the hook breaks the graph and
    runs outside it (Note [tba under torch.compile]), except in a graph for tba's own backend,
    whose ops do the hook's work inside the graph (Note [Offload inside the compiled graph] in
    tba/compile/__init__.py): there it traces to nothing."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compat.is_compiling():
            if compat.tracing_for_tba():
                return None
            compat.note_traced_hook()
            return compat.call_outside_compile(self.fn, *args, **kwargs)
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return (_make_inert, ())
