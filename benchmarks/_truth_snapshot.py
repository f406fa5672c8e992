"""Where the peak lies (gpu_truth.py): a CUDA memory snapshot of one training step and a PNG of
the allocated bytes over that step, derived from the snapshot's trace entries.

``record_step(step, path)`` runs ``step()`` under ``torch.cuda.memory._record_memory_history``
and pickles ``torch.cuda.memory._snapshot()`` (open it at https://pytorch.org/memory_viz).
``timeline(snapshot, start_bytes)`` replays the trace of device 0: ``alloc`` adds a block's
size, ``free_completed`` takes it away (a free is requested when the tensor dies and completed
once the streams that used the block are done with it; the allocator counts the block until
then). ``plot`` draws one curve per step.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


def record_step(step: Callable[[], None], path: Path, max_entries: int = 1_000_000) -> tuple[dict[str, Any], int]:
    """Run ``step`` with the allocator's history recorded; write the snapshot to ``path``.
    Returns the snapshot and the bytes allocated when recording started."""
    import torch

    torch.cuda.synchronize()
    start = int(torch.cuda.memory_allocated())
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = trim_frames(torch.cuda.memory._snapshot())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return snapshot, start


def trim_frames(snapshot: dict[str, Any], max_frames: int = 12) -> dict[str, Any]:
    """Keep the innermost ``max_frames`` stack frames of every trace entry and block (the
    archive must stay small enough to come back from the GPU machine)."""
    for entries in snapshot.get("device_traces") or []:
        for entry in entries:
            if isinstance(entry.get("frames"), list):
                entry["frames"] = entry["frames"][:max_frames]
    for segment in snapshot.get("segments") or []:
        for block in segment.get("blocks") or []:
            if isinstance(block.get("frames"), list):
                block["frames"] = block["frames"][:max_frames]
    return snapshot


def timeline(snapshot: dict[str, Any], start_bytes: int, device: int = 0) -> tuple[list[float], list[int]]:
    """``(milliseconds since the first entry, allocated bytes)`` after each alloc and completed
    free of ``device``'s trace (entry index for time when the trace has no ``time_us``)."""
    traces = snapshot.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    times: list[float] = []
    allocated: list[int] = []
    now = start_bytes
    t0 = None
    for i, entry in enumerate(entries):
        action = entry.get("action")
        if action == "alloc":
            now += int(entry["size"])
        elif action == "free_completed":
            now -= int(entry["size"])
        else:
            continue
        t = entry.get("time_us")
        if t is None:
            times.append(float(i))
        else:
            t0 = t if t0 is None else t0
            times.append((t - t0) / 1e3)
        allocated.append(now)
    return times, allocated


def plot(curves: dict[str, tuple[list[float], list[int]]], path: Path, title: str) -> None:
    """One line of allocated GiB over the step per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, (times, allocated) in curves.items():
        ax.plot(times, [a / 2**30 for a in allocated], label=f"{label} (peak {max(allocated, default=0) / 2**30:.2f} GiB)")
    ax.set_xlabel("time in the step (ms; entry index where the trace has no time)")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
