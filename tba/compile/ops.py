"""tba's custom ops in compiled graphs: ``tba::store``, ``tba::prefetch``, ``tba::reload``.

Note [Effects as ops]: each op is a ``torch.library`` op with a fake implementation, so
AOTAutograd, Inductor and ``aot_eager`` run them as they are, and is ordered by data alone:
store ``i`` takes store ``i - 1``'s key (the stores run in graph order, which is what opens,
fills and closes the cache's forward); a reload takes its group's key, the marker of the
prefetch that started its load. Neither a reload nor a prefetch takes any other input: under
Inductor the scheduler places them (Note [Backward in plain Inductor's order] in
scheduling.py), elsewhere the graph runs in the order the rewrite gave it. All three are registered as side-effecting (``torch.fx.has_side_effect``: kept by dead
code elimination and by Inductor, never constant-folded). The store requires its inputs at
their exact traced strides (``needs_exact_strides``; the rewrite records the traced values as
``eager_input_vals``), so the tensor the cache keeps has the geometry the reload's fake
implementation promises backward. Outputs never alias inputs (their schemas say so), which is
why the key and carriers are fresh tensors (Note [Keys and shape carriers] in runtime.py).

Registered when ``tba.compile`` is imported (never by ``import tba``).
"""

from __future__ import annotations

import torch
from torch.fx import has_side_effect

from tba.compile import runtime

__all__ = ["STORE", "PREFETCH", "RELOAD", "OPS"]


# The ops are defined with torch.library's low-level API and one CompositeExplicitAutograd
# kernel each (as torch's own ``ao.wait_tensor``): a graph calls them with grad mode off, and
# ``torch.library.custom_op``'s Python wrappers (an autograd layer, an aliasing check per call)
# cost a third of a small model's step (measured: GPT-2 6 x 128, batch 4, CPU).
_LIBRARY = torch.library.Library("tba", "DEF")  # noqa: TOR901  (kept alive by the module)
_LIBRARY.define(
    "store(Tensor[] tensors, Tensor? after, int index, int graph, str? module, Tensor? marker, "
    "str? marker_path, bool last) -> Tensor[]",
    tags=(torch.Tag.needs_exact_strides,),
)
_LIBRARY.define("prefetch(Tensor[] keys) -> Tensor")
_LIBRARY.define(
    "reload(Tensor key, Tensor shape, int member, int ndim, Tensor? prefetched) -> Tensor"
)


@torch.library.impl(_LIBRARY, "store", "CompositeExplicitAutograd")
def _store(tensors: list[torch.Tensor], after: torch.Tensor | None, index: int, graph: int,
           module: str | None, marker: torch.Tensor | None, marker_path: str | None,
           last: bool) -> list[torch.Tensor]:
    """Hand one storage's saved tensors to the tensor cache; returns the key and the members'
    shape carriers (what backward gets instead of the tensors). ``module``, ``marker`` and
    ``marker_path`` tell its unit (Note [Units at run time] in plan.py)."""
    return runtime.store(tensors, index, graph, module, marker, marker_path, last)


def _store_fake(tensors: list[torch.Tensor], after: torch.Tensor | None, index: int, graph: int,
                module: str | None, marker: torch.Tensor | None, marker_path: str | None,
                last: bool) -> list[torch.Tensor]:
    key = torch.empty(1, dtype=torch.uint8, device=tensors[0].device)
    return [key, *(runtime.carrier(tensor) for tensor in tensors)]


@torch.library.impl(_LIBRARY, "prefetch", "CompositeExplicitAutograd")
def _prefetch(keys: list[torch.Tensor]) -> torch.Tensor:
    """Start loading the groups of ``keys``; returns a marker the groups' reloads take."""
    return runtime.prefetch(keys)


def _prefetch_fake(keys: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(1, dtype=torch.uint8, device=keys[0].device)


@torch.library.impl(_LIBRARY, "reload", "CompositeExplicitAutograd")
def _reload(key: torch.Tensor, shape: torch.Tensor, member: int, ndim: int,
            prefetched: torch.Tensor | None) -> torch.Tensor:
    """Member ``member`` of ``key``'s group, back from the cache (waiting for its load)."""
    return runtime.reload(key, shape, member, ndim)


def _reload_fake(key: torch.Tensor, shape: torch.Tensor, member: int, ndim: int,
                 prefetched: torch.Tensor | None) -> torch.Tensor:
    size, stride = runtime.geometry(shape, ndim)
    return torch.empty_strided(size, stride, dtype=shape.dtype, device=shape.device)


for _name, _fake in (("store", _store_fake), ("prefetch", _prefetch_fake), ("reload", _reload_fake)):
    torch.library.register_fake(f"tba::{_name}", _fake, lib=_LIBRARY)

STORE = torch.ops.tba.store.default
PREFETCH = torch.ops.tba.prefetch.default
RELOAD = torch.ops.tba.reload.default
OPS = frozenset((STORE, PREFETCH, RELOAD))
for _op in OPS:
    has_side_effect(_op)
