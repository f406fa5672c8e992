"""Every environment variable tba reads, in one place (see the README's table).

Variables are read when a value is needed, never at import.
"""

from __future__ import annotations

import os

__all__ = ["ssd_dir", "require_gpu"]


def ssd_dir() -> str | None:
    """``TBA_SSD_DIR``: default parent directory of the SSD offloader's private directory."""
    value = os.environ.get("TBA_SSD_DIR", "").strip()
    return value or None


def require_gpu() -> bool:
    """``TBA_REQUIRE_GPU=1``: tests that need CUDA fail instead of skipping (for GPU runners)."""
    return os.environ.get("TBA_REQUIRE_GPU", "0").strip() not in ("", "0", "false", "no")
