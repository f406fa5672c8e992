"""What a benchmark ran on: the environment header every benchmark prints and saves."""

from __future__ import annotations

import os
import platform
import shlex
import sys

__all__ = ["cpu_name", "describe"]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
