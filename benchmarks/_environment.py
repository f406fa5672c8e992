"""What a benchmark ran on: the environment header every benchmark prints and saves."""

from __future__ import annotations

import os
import platform
import shlex
import sys

from tba.rok._worker import cpu_name  # one definition: `tba rok` ships it

__all__ = ["cpu_name", "describe"]


def describe(device: str) -> dict[str, object]:
    """Device, versions and command line of this run (``device``: "cpu" or "cuda")."""
    import torch

    import tba

    if device == "cuda" and torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        name = f"cpu ({cpu_name()}, {os.cpu_count()} cores)"
    return {
        "device": name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tba": tba.__version__,
        "command": shlex.join([sys.executable, *sys.argv]),
    }
