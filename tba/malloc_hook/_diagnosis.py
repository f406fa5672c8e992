"""One question for the SSD offloader: will GDS transfers run on cuFile-registered memory?"""

from __future__ import annotations

import sys

from tba.malloc_hook._status import status

__all__ = ["gds_registration_problem"]


def _torch_runtime_problem(num_allocations: int) -> str | None:
    """Checks PyTorch's live allocator, only if torch is imported and CUDA already initialised
    (this must never initialise CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return (
            f"PyTorch's CUDA allocator backend is {backend!r}, which does not allocate with "
            "cudaMalloc, so the malloc hook registers nothing: use the native backend"
        )
    reserved_bytes = int(torch.cuda.memory_reserved())
    if reserved_bytes > 0 and num_allocations == 0:
        return (
            f"PyTorch holds {reserved_bytes} bytes of CUDA memory but the malloc hook saw no "
            "cudaMalloc: the memory came another way (expandable_segments switched on at run "
            "time, or a CUDA runtime linked statically), so none of it is registered with cuFile"
        )
    return None


def gds_registration_problem() -> str | None:
    """Why GDS transfers in this process will not run on cuFile-registered memory, or None.

    The SSD offloader calls this when it uses GPUDirect Storage (kvikio not in compat mode) and
    warns once with the message: unregistered GPU memory still works, but cuFile moves it
    through bounce buffers at a fraction of the speed.

    Returns:
        A message naming the cause and the fix, or None when the hook is preloaded, enabled,
        every allocation it saw that was large enough got registered, and PyTorch's allocator
        hands its memory to the hook.

    Example:
        >>> from tba import malloc_hook
        >>> problem = malloc_hook.gds_registration_problem()
        >>> if problem is not None:
        ...     logger.warning("GDS without registered buffers: %s", problem)  # doctest: +SKIP
    """
    current = status()
    if current.allocator_problem is not None:
        return current.allocator_problem
    if not current.preloaded:
        return (
            "the CUDA malloc hook is not preloaded, so PyTorch's CUDA memory is not registered "
            "with cuFile and GDS transfers go through bounce buffers: start the process with "
            "LD_PRELOAD=$(python -m tba.malloc_hook --path)"
        )
    if not current.enabled:
        return (
            "the CUDA malloc hook is disabled (TBA_HOOK_ENABLED=0 or "
            "tba.malloc_hook.set_enabled(False)), so new CUDA segments are not registered with "
            "cuFile"
        )
    if current.num_failed > 0:
        return (
            f"{current.num_failed} CUDA allocations of at least {current.min_bytes} bytes could "
            f"not be registered with cuFile; last error: {current.last_error}"
        )
    return _torch_runtime_problem(current.num_allocations)
