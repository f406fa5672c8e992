"""The preloaded hook's state, read through ctypes from the process's global symbols.

Nothing here loads the library: ``status()`` only looks up symbols that ``LD_PRELOAD`` already
put into the process. The ctypes structure mirrors ``struct tba_hook_status`` in
``csrc/cuda_malloc_hook/tba_cuda_malloc_hook.h``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from tba.malloc_hook._alloc_conf import allocator_problem
from tba.malloc_hook._errors import MallocHookError
from tba.malloc_hook._library import LIBRARY_NAME

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

__all__ = ["HookStatus", "CufileState", "RegisterMode", "status", "set_enabled", "tagged_allocations"]

CufileState = Literal["not_loaded", "ready", "missing", "broken"]
_CUFILE_STATES: tuple[CufileState, ...] = ("not_loaded", "ready", "missing", "broken")
RegisterMode = Literal["all", "tba"]
_REGISTER_MODES: tuple[RegisterMode, ...] = ("all", "tba")
_SKIP_COUNTERS = ("num_skipped_capturing", "num_skipped_untagged")

_COUNTERS = (
    "enabled",
    "min_bytes",
    "max_segments",
    "num_allocations",
    "num_frees",
    "num_registered",
    "num_deregistered",
    "num_failed",
    "num_deregister_failed",
    "num_live_registered",
    "registered_bytes",
)


class _StatusStruct(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_uint64) for name in _COUNTERS]
        + [("cufile_state", ctypes.c_int64), ("register_mode", ctypes.c_uint64)]
        + [(name, ctypes.c_uint64) for name in _SKIP_COUNTERS]
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HookStatus:
    """What the CUDA malloc hook has done in this process.

    Counters cover the life of the process; ``num_live_registered`` and ``registered_bytes``
    describe the allocations registered right now.

    Attributes:
        preloaded: the hook library is in this process (through ``LD_PRELOAD``). When False,
            every other field is zero / False / None except ``allocator_problem``.
        enabled: new allocations are being registered (``TBA_HOOK_ENABLED``, ``set_enabled``).
        num_allocations: successful ``cudaMalloc`` calls seen.
        num_registered: allocations registered with ``cuFileBufRegister``.
        num_failed: allocations of at least ``min_bytes`` that could not be registered (cuFile
            missing or failing, registry full); they still succeeded.
        registered_bytes: bytes of the allocations registered now.
        last_error: the most recent failure, or None.
        num_frees: ``cudaFree`` calls seen (non-NULL pointers).
        num_deregistered: ``cuFileBufDeregister`` calls made, each just before its free.
        num_deregister_failed: of those, how many returned an error.
        num_live_registered: allocations registered now.
        min_bytes: allocations of at least this size are registered (``TBA_HOOK_MIN_BYTES``).
        max_segments: most allocations registered at once (``TBA_HOOK_MAX_SEGMENTS``).
        cufile_state: ``not_loaded`` (nothing to register yet), ``ready``, ``missing`` (not
            found; tried again at the next allocation) or ``broken`` (loaded but unusable).
        allocator_problem: why PyTorch's allocator settings hide its memory from the hook
            (``expandable_segments``, ``backend:cudaMallocAsync``), or None.
        register_mode: ``all`` (every allocation of at least ``min_bytes``) or ``tba`` (only
            those made inside ``tagged_allocations()``: tba's reload buffers), from
            ``TBA_HOOK_REGISTER``.
        num_skipped_capturing: allocations left unregistered because they were made during a
            CUDA graph capture.
        num_skipped_untagged: allocations left unregistered because the mode is ``tba`` and
            the allocating thread was not tagged.
    """

    preloaded: bool
    enabled: bool
    num_allocations: int
    num_registered: int
    num_failed: int
    registered_bytes: int
    last_error: str | None
    num_frees: int
    num_deregistered: int
    num_deregister_failed: int
    num_live_registered: int
    min_bytes: int
    max_segments: int
    cufile_state: CufileState
    allocator_problem: str | None
    register_mode: RegisterMode = "all"
    num_skipped_capturing: int = 0
    num_skipped_untagged: int = 0


@dataclasses.dataclass(frozen=True)
class _Hook:
    # ctypes foreign functions (their argtypes/restype are set once, below).
    get_status: CFuncPtr
    set_enabled: CFuncPtr
    last_error: CFuncPtr
    set_thread_tagged: CFuncPtr


@functools.cache
def _preloaded_hook() -> _Hook | None:
    """The hook's functions from the global namespace, or None when it is not preloaded."""
    process = ctypes.CDLL(None)
    try:
        hook = _Hook(
            process.tba_hook_get_status,
            process.tba_hook_set_enabled,
            process.tba_hook_last_error,
            process.tba_hook_set_thread_tagged,
        )
    except AttributeError:
        return None
    hook.get_status.argtypes = [ctypes.POINTER(_StatusStruct), ctypes.c_size_t]
    hook.get_status.restype = ctypes.c_int
    hook.set_enabled.argtypes = [ctypes.c_int]
    hook.set_enabled.restype = ctypes.c_int
    hook.last_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    hook.last_error.restype = ctypes.c_size_t
    hook.set_thread_tagged.argtypes = [ctypes.c_int]
    hook.set_thread_tagged.restype = ctypes.c_int
    return hook


def _last_error(hook: _Hook) -> str | None:
    buffer = ctypes.create_string_buffer(1024)
    length = hook.last_error(buffer, len(buffer))
    return buffer.value.decode(errors="replace") if length else None


def status() -> HookStatus:
    """The hook's counters and settings in this process. Never loads the library.

    Returns:
        A snapshot; ``preloaded`` is False when the process was not started with the hook in
        ``LD_PRELOAD``.

    Raises:
        MallocHookError: the preloaded library is from another version of tba.

    Example:
        >>> from tba import malloc_hook
        >>> s = malloc_hook.status()
        >>> if s.preloaded:
        ...     print(f"{s.num_live_registered} segments, {s.registered_bytes} bytes registered")
    """
    problem = allocator_problem()
    hook = _preloaded_hook()
    if hook is None:
        zeros = {name: 0 for name in _COUNTERS if name != "enabled"}
        return HookStatus(
            preloaded=False,
            enabled=False,
            last_error=None,
            cufile_state="not_loaded",
            allocator_problem=problem,
            register_mode="all",
            **zeros,
        )
    raw = _StatusStruct()
    if hook.get_status(ctypes.byref(raw), ctypes.sizeof(raw)) != 0:
        raise MallocHookError(
            f"the preloaded {LIBRARY_NAME} reports its status in another layout than this tba "
            "expects: preload the library of this installation (python -m tba.malloc_hook --path)"
        )
    counters = {name: int(getattr(raw, name)) for name in _COUNTERS + _SKIP_COUNTERS if name != "enabled"}
    return HookStatus(
        preloaded=True,
        enabled=bool(raw.enabled),
        last_error=_last_error(hook),
        cufile_state=_CUFILE_STATES[raw.cufile_state] if 0 <= raw.cufile_state < 4 else "broken",
        allocator_problem=problem,
        register_mode=_REGISTER_MODES[raw.register_mode] if raw.register_mode < 2 else "all",
        **counters,
    )


def set_enabled(enabled: bool) -> bool:
    """Switches registration of new CUDA allocations on or off at run time.

    Allocations registered earlier are still deregistered when freed.

    Args:
        enabled: register allocations made from now on.

    Returns:
        The previous setting.

    Raises:
        MallocHookError: the hook is not preloaded in this process.

    Example:
        >>> was_enabled = malloc_hook.set_enabled(False)  # doctest: +SKIP
    """
    hook = _preloaded_hook()
    if hook is None:
        raise MallocHookError(
            "the CUDA malloc hook is not preloaded in this process: start it with "
            "LD_PRELOAD=$(python -m tba.malloc_hook --path)"
        )
    return bool(hook.set_enabled(1 if enabled else 0))


@contextlib.contextmanager
def tagged_allocations() -> Iterator[None]:
    """Tags the CUDA allocations this thread makes inside the block as tba's own.

    With ``TBA_HOOK_REGISTER=tba`` the hook registers only tagged allocations (Note [Tagged
    allocations] in ``csrc/cuda_malloc_hook/hook.c``): wrap the allocation of reload buffers in
    this. Without the hook preloaded it does nothing (there is nothing to tag), and it never
    loads the library.

    Example:
        >>> with malloc_hook.tagged_allocations():
        ...     buffer = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
    """
    hook = _preloaded_hook()
    if hook is None:
        yield
        return
    previous = hook.set_thread_tagged(1)
    try:
        yield
    finally:
        hook.set_thread_tagged(previous)
