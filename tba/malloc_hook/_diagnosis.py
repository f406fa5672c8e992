"""One question for the SSD offloader: will GDS transfers run on cuFile-registered memory?"""

from __future__ import annotations

import logging
import sys
import threading
import warnings

from tba.malloc_hook._status import HookStatus, status
from tba.settings import REGISTRATION_SHORTFALL_MIN_RESERVED_BYTES, REGISTRATION_SHORTFALL_RATIO


__all__ = ["gds_registration_problem", "registration_shortfall", "warn_if_registration_short"]

logger = logging.getLogger(__name__)

# Note [Registration shortfall]: with TBA_HOOK_REGISTER=all the hook should see most of what
# PyTorch reserves; PyTorch's 2 MiB small-pool segments (below the default 4 MiB threshold)
# and a few failed or skipped registrations account for some difference, so only less than
# half registered counts as a shortfall, and only once PyTorch holds a real amount of memory
# (tba.settings).
_warn_lock = threading.Lock()
_warned_shortfall = False


def registration_shortfall(current: HookStatus, reserved_bytes: int) -> str | None:
    """Why far less is registered with cuFile than PyTorch reserves, or None.

    Args:
        current: the hook's status (``status()``).
        reserved_bytes: ``torch.cuda.memory_reserved()`` of the device GDS reads from.

    Returns:
        A message naming the numbers, the likely cause and the fix, or None when the hook is
        not preloaded, registers only tba's buffers (``TBA_HOOK_REGISTER=tba``: a small share
        is expected), PyTorch holds less than 256 MiB, or at least half of it is registered.
    """
    if not current.preloaded or current.register_mode != "all":
        return None
    if reserved_bytes < REGISTRATION_SHORTFALL_MIN_RESERVED_BYTES:
        return None
    if current.registered_bytes >= REGISTRATION_SHORTFALL_RATIO * reserved_bytes:
        return None
    causes = []
    if current.num_skipped_capturing:
        causes.append(f"{current.num_skipped_capturing} allocations made during CUDA graph capture")
    if current.num_failed:
        causes.append(f"{current.num_failed} failed registrations (last error: {current.last_error})")
    if not current.enabled:
        causes.append("registration switched off")
    cause = "; ".join(causes) if causes else (
        "segments below TBA_HOOK_MIN_BYTES, or memory PyTorch did not get from cudaMalloc"
    )
    return (
        f"the malloc hook has {current.registered_bytes} bytes registered with cuFile but "
        f"PyTorch reserves {reserved_bytes} bytes of CUDA memory ({cause}): GDS transfers from "
        "unregistered memory go through bounce buffers; check the hook's status "
        "(tba.malloc_hook.status()) and TBA_HOOK_MIN_BYTES"
    )


def warn_if_registration_short(reserved_bytes: int | None = None) -> str | None:
    """Warn once per process when ``registration_shortfall`` finds one; returns its message.

    Call it once training is under way (after the first step), when PyTorch has reserved
    what it needs. ``reserved_bytes`` defaults to ``torch.cuda.memory_reserved()`` if torch is
    imported and CUDA initialised (this never initialises CUDA).
    """
    global _warned_shortfall
    if reserved_bytes is None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None
        reserved_bytes = int(torch.cuda.memory_reserved())
    problem = registration_shortfall(status(), reserved_bytes)
    if problem is None:
        return None
    with _warn_lock:
        first, _warned_shortfall = not _warned_shortfall, True
    if first:
        warnings.warn(f"tba: {problem} (this warning is shown once)", RuntimeWarning, stacklevel=2)
    logger.debug("registration shortfall: %s", problem)
    return problem


def _torch_runtime_problem(current: HookStatus) -> str | None:
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
    if reserved_bytes > 0 and current.num_allocations == 0:
        return (
            f"PyTorch holds {reserved_bytes} bytes of CUDA memory but the malloc hook saw no "
            "cudaMalloc: the memory came another way (expandable_segments switched on at run "
            "time, or a CUDA runtime linked statically), so none of it is registered with cuFile"
        )
    return registration_shortfall(current, reserved_bytes)


def gds_registration_problem() -> str | None:
    """Why GDS transfers in this process will not run on cuFile-registered memory, or None.

    The SSD offloader calls this when it uses GPUDirect Storage (kvikio not in compat mode) and
    warns once with the message: unregistered GPU memory still works, but cuFile moves it
    through bounce buffers at a fraction of the speed.

    Returns:
        A message naming the cause and the fix, or None when the hook is preloaded, enabled,
        every allocation it saw that was large enough got registered, PyTorch's allocator
        hands its memory to the hook, and (``TBA_HOOK_REGISTER=all``) at least half of what
        PyTorch reserves is registered (Note [Registration shortfall]).

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
    return _torch_runtime_problem(current)
