"""What the pack hook returns besides handles: packed wrapper subclasses and which subclasses
may be flattened; and PyTorch's in-place error, which tba raises where autograd no longer
checks."""

from __future__ import annotations

from typing import Any

import torch

from tba.errors import TBAError

__all__ = ["PackedSubclass", "offloadable_subclass", "modified_error", "NESTED_TYPE_NAME"]

NESTED_TYPE_NAME = "NestedTensor"  # torch.nested._internal.nested_tensor.NestedTensor


# Note [Subclasses with pending work]: autograd packs an op's saved inputs *before* the op
# runs, so a wrapper subclass that finishes its data inside ``__torch_dispatch__``
# (``AsyncCollectiveTensor`` waits on its collective there) is packed while a collective may
# still be writing it: copying its inner tensor then would read a buffer NCCL is filling. Only
# subclasses known to hold finished plain data are flattened and offloaded: DTensor, jagged
# NestedTensor, float8 training tensors; every other subclass (and any of those whose inner
# tensors are such subclasses: they go through this check again) stays with autograd.
OFFLOADABLE_SUBCLASS_NAMES = frozenset({"DTensor", "NestedTensor"})


def offloadable_subclass(cls: type) -> bool:
    name = cls.__name__
    return name in OFFLOADABLE_SUBCLASS_NAMES or "Float8" in name


class PackedSubclass:
    """What autograd keeps for a wrapper-subclass tensor: its packed inner tensors."""

    __slots__ = ("cls", "inner", "context", "size", "stride")

    def __init__(
        self, cls: type[torch.Tensor], inner: dict[str, Any], context: Any, size: torch.Size,
        stride: tuple[int, ...],
    ) -> None:
        # ``inner``: packed inner tensors and the subclass's other attributes (arbitrary);
        # ``context``: the subclass's own flatten context (arbitrary).
        self.cls, self.inner, self.context, self.size, self.stride = cls, inner, context, size, stride


def modified_error(
    shape: tuple[int, ...], dtype: torch.dtype, where: str | None, expected: int, found: int | None
) -> TBAError:
    """PyTorch's in-place error, raised by tba where autograd no longer checks."""
    found_text = (
        f"is at version {found}" if found is not None
        else "was modified in place while tba was offloading it"
    )
    return TBAError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{dtype} {list(shape)}], saved for backward in {where or 'the model'}, "
        f"{found_text}; expected version {expected} instead. (tba checks this because autograd "
        "does not under saved_tensors_hooks.) Hint: clone the tensor before modifying it in "
        "place, or make the modification out-of-place."
    )
