"""The error the CUDA malloc hook's Python side raises."""

from __future__ import annotations

from tba.errors import TBAError

__all__ = ["MallocHookError"]


class MallocHookError(TBAError):
    """The hook library is not built, not found, or not preloaded where it has to be."""
