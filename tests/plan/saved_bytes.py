"""Count what autograd really saves in a forward pass (private; validates :mod:`tba.plan`).

Counts distinct storages the way tba's cache keys them (each storage once, whole storage
bytes), leaving out parameters, buffers and their views, with ``saved_tensors_hooks``. Use
it without tba's cache installed: both would register saved-tensor hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["SavedBytes", "count_saved_bytes"]


@dataclass
class SavedBytes:
    """Result of ``count_saved_bytes``."""

    total_bytes: int = 0
    num_storages: int = 0
    num_saved: int = 0
    num_parameter_saves: int = 0
    by_shape: dict[tuple, int] = field(default_factory=dict)


def count_saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[SavedBytes, torch.Tensor]:
    """Run ``forward()`` under counting hooks; return the count and the forward's output.

    The saved tensors stay alive until the caller runs backward (or drops the output), so
    storages are not recycled during the count.
    """
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    result = SavedBytes()
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        result.num_saved += 1
        if key in excluded:
            result.num_parameter_saves += 1
        elif key not in seen:
            seen[key] = t  # keep alive: a freed storage's address may be reused in this pass
            result.num_storages += 1
            result.total_bytes += storage.nbytes()
            shape = (tuple(t.shape), str(t.dtype))
            result.by_shape[shape] = result.by_shape.get(shape, 0) + storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    seen.clear()
    return result, out
