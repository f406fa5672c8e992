"""Running the tba side of a parity check under PyTorch's CUDA stream sanitizer.

Note [Stream sanitizer]: ``torch.cuda._sanitizer`` (CSAN, private to PyTorch, checked against
torch 2.13) records which stream each kernel reads and writes each tensor on, and which
events and synchronisations order the streams; a kernel touching memory that another stream
may still be using without an ordering raises ``CUDASanitizerErrors``. Its dispatch mode is
entered on the calling thread (autograd carries it into backward), so it sees the forward and
backward kernels, the reload buffers' consumption, every event record and wait, and frees;
the offloader's own copies on tba's worker threads are outside its view. Importing it switches
on PyTorch's GPU trace callbacks for the rest of the process, so it is imported only when used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["stream_sanitizer"]


def _cuda_sanitizer() -> Any:
    from torch.cuda import _sanitizer

    return _sanitizer.cuda_sanitizer


@contextlib.contextmanager
def stream_sanitizer(sanitizer: Any = None) -> Iterator[None]:
    """Run the block under the CUDA stream sanitizer (Note [Stream sanitizer]), then switch it
    off again, unless it was already on (enabled by the program: then it stays on).

    Args:
        sanitizer: the object with ``enabled``, ``enable()`` and ``disable()`` (default:
            PyTorch's ``torch.cuda._sanitizer.cuda_sanitizer``; tests pass a fake).
    """
    sanitizer = sanitizer if sanitizer is not None else _cuda_sanitizer()
    if sanitizer.enabled:
        yield
        return
    sanitizer.enable()
    try:
        yield
    finally:
        sanitizer.disable()
