"""Waiting for the copies queued on a CUDA stream without spinning a core."""

from __future__ import annotations

import torch

__all__ = ["wait_for_stream"]


def wait_for_stream(device: torch.device) -> None:
    """Block the calling thread until the work queued so far on ``device``'s current stream has
    run. A blocking event sleeps in the driver; ``stream.synchronize()`` and default events spin
    a CPU core, which the training thread needs (issue 16, finding 7)."""
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    event.synchronize()
