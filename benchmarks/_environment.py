"""What a benchmark ran on: the environment header every benchmark prints and saves."""

from __future__ import annotations

import os
import platform
import shlex
import sys

from tba.rok._worker import cpu_name  # one definition: `tba rok` ships it

__all__ = ["command_line", "cpu_name", "describe"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_line(argv: list[str]) -> str:
    """``argv`` as a command a reader can run from the repository root: ``python`` for the
    interpreter and paths inside the repository relative to it (a committed figure names no
    machine's directories)."""

    def portable(arg: str) -> str:
        path = os.path.abspath(arg) if os.path.isabs(arg) or os.path.exists(arg) else None
        if path is not None and path.startswith(_ROOT + os.sep):
            return os.path.relpath(path, _ROOT)
        return arg

    return shlex.join(["python", *(portable(arg) for arg in argv)])


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
        "command": command_line(sys.argv),
    }
