"""CUDA malloc hook: registers PyTorch's CUDA segments with cuFile for GPUDirect Storage.

``libtba_cuda_malloc_hook.so`` is loaded with ``LD_PRELOAD``; it wraps ``cudaMalloc`` and
``cudaFree``, registers every allocation of at least ``TBA_HOOK_MIN_BYTES`` (or, with
``TBA_HOOK_REGISTER=tba``, only those made inside ``tagged_allocations()``; never during a
CUDA graph capture) with
``cuFileBufRegister`` and deregisters it just before the real free, so kvikio moves tensors
between GPU memory and NVMe at full speed while PyTorch keeps its caching allocator::

    LD_PRELOAD=$(python -m tba.malloc_hook --path) torchrun train.py

This package finds the library and reads its state; importing it loads nothing.

Example:
    >>> from tba import malloc_hook
    >>> s = malloc_hook.status()
    >>> s.preloaded, s.num_registered, s.registered_bytes  # doctest: +SKIP
    (True, 12, 1610612736)
"""

from __future__ import annotations

from tba.malloc_hook._diagnosis import (
    gds_registration_problem,
    registration_shortfall,
    warn_if_registration_short,
)
from tba.malloc_hook._errors import MallocHookError
from tba.malloc_hook._library import LIBRARY_NAME, cufile_library_path, library_path
from tba.malloc_hook._status import (
    CufileState,
    HookStatus,
    RegisterMode,
    set_enabled,
    status,
    tagged_allocations,
)

__all__ = [
    "LIBRARY_NAME",
    "CufileState",
    "HookStatus",
    "MallocHookError",
    "RegisterMode",
    "cufile_library_path",
    "gds_registration_problem",
    "library_path",
    "registration_shortfall",
    "set_enabled",
    "status",
    "tagged_allocations",
    "warn_if_registration_short",
]
