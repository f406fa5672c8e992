"""Count what autograd really saves in a forward pass (test helper; validates :mod:`tba.plan`).

Counts distinct storages (each storage once, whole storage bytes), leaving out parameters,
buffers and their views, with ``saved_tensors_hooks``. Use it without tba's cache installed:
both would register saved-tensor hooks. ``cache_saved_bytes`` measures the same through the
cache's public stats, which is what the planner promises to predict.
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
    # Storages saved through more than one tensor family (a tensor and its views share one
    # version counter; unrelated tensors on one storage do not): "shape dtype: N families".
    multi_family_storages: list[str] = field(default_factory=list)


def count_saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[SavedBytes, torch.Tensor]:
    """Run ``forward()`` under counting hooks; return the count and the forward's output.

    The saved tensors stay alive until the caller runs backward (or drops the output), so
    storages are not recycled during the count.
    """
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    result = SavedBytes()
    seen: dict[int, list[torch.Tensor]] = {}  # storage -> one tensor per family

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        result.num_saved += 1
        family = t._base if t._base is not None else t
        if key in excluded:
            result.num_parameter_saves += 1
        elif key not in seen:
            seen[key] = [family]  # keep alive: a freed storage's address may be reused in this pass
            result.num_storages += 1
            result.total_bytes += storage.nbytes()
            shape = (tuple(t.shape), str(t.dtype))
            result.by_shape[shape] = result.by_shape.get(shape, 0) + storage.nbytes()
        elif not any(f is family for f in seen[key]):
            seen[key].append(family)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    result.multi_family_storages = [f"{tuple(fs[0].shape)} {fs[0].dtype}: {len(fs)} families"
                                    for fs in seen.values() if len(fs) > 1]
    seen.clear()
    return result, out


def cache_saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor], *, steps: int = 2):
    """Bytes tba's cache held for one step of ``forward().backward()`` (offloaded + kept).

    Everything is managed (``min_offload_bytes=0``, ``keep_last_modules=0``, CPU tensors) and
    measured through ``cache.stats()`` of the last of ``steps`` steps. Every store completes
    before backward starts, so no store is cancelled because its tensor died first (a store
    still queued when backward frees the tensor is neither offloaded nor kept: how many
    are depends on timing). Returns the stats.
    """
    import tba

    cache = tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
                                       keep_last_modules=0, adaptive=False)
    try:
        for _ in range(steps):  # the stats describe the last completed step
            loss = forward()
            cache.wait_for_stores(timeout_s=60)
            loss.backward()
        return cache.stats()
    finally:
        cache.close()
