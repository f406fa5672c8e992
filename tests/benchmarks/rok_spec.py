"""A small point spec for the ROK worker (``tba.rok._worker.run_point``), shared by its tests."""

from __future__ import annotations

from typing import Any


def spec(**kw: Any) -> dict[str, Any]:
    """A CPU point of a 2-block GPT-2 (tiny: every saved tensor is a few KiB), overridden by ``kw``."""
    out: dict[str, Any] = dict(
        device="cpu", model=dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=16), dtype="float32",
        strategy="keep", batch_size=2, steps=1, warmup_steps=0, min_offload_bytes=0, keep_last_modules=1,
        adaptive=False, ssd_dir=None, num_threads=None, mmap_threshold_bytes=None)
    out.update(kw)
    return out
