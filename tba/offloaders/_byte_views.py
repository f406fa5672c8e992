"""numpy views of CPU byte tensors that leave the tensors alone."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["bytes_view"]


def bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy ``uint8`` view of a contiguous CPU byte tensor's memory (the caller keeps the
    tensor alive while the view is used). ``Tensor.numpy()`` would mark the storage as not
    resizable for good, which breaks frameworks that later free a saved storage with
    ``resize_(0)`` (FSDP, Megatron) and is visible to the user's own code."""
    n = tensor.numel()
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(tensor.data_ptr()))
