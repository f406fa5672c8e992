"""Every environment variable tba reads, in one place (docs/options.md lists them).

Variables are read when a value is needed, never at import.
"""

from __future__ import annotations

import os

__all__ = ["ssd_dir", "require_gpu", "check_invariants", "hook_library", "pytorch_alloc_conf"]


def ssd_dir() -> str | None:
    """``TBA_SSD_DIR``: default parent directory of the SSD offloader's private directory."""
    value = os.environ.get("TBA_SSD_DIR", "").strip()
    return value or None


def require_gpu() -> bool:
    """``TBA_REQUIRE_GPU=1``: tests that need CUDA fail instead of skipping (for GPU runners)."""
    return os.environ.get("TBA_REQUIRE_GPU", "0").strip() not in ("", "0", "false", "no")


def check_invariants() -> bool:
    """``TBA_CHECK_INVARIANTS=1``: every cache checks its bookkeeping after each completed step
    and raises ``TBAError`` on a violation (the test suite turns it on; costs O(entries) per
    step)."""
    return os.environ.get("TBA_CHECK_INVARIANTS", "0").strip() not in ("", "0", "false", "no")


def ssd_dirs() -> tuple[str, ...] | None:
    """``TBA_SSD_DIR`` as a tuple of directories: several (one per drive) are joined by ``os.pathsep``."""
    value = ssd_dir()
    if value is None:
        return None
    dirs = tuple(part.strip() for part in value.split(os.pathsep) if part.strip())
    return dirs or None


def hook_library() -> str | None:
    """``TBA_HOOK_LIBRARY``: path of the CUDA malloc hook library, instead of the packaged one."""
    value = os.environ.get("TBA_HOOK_LIBRARY", "").strip()
    return value or None


def pytorch_alloc_conf() -> tuple[str, str] | None:
    """PyTorch's CUDA allocator settings as ``(variable, value)``, or None when unset.

    PyTorch reads the first of ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF`` that is set;
    tba reads them only to tell whether the CUDA malloc hook can see PyTorch's allocations.
    """
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        value = os.environ.get(name)
        if value is not None:
            return name, value
    return None
