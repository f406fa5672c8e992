"""Controllable fakes for the offloader and stream layer, so CPU tests drive the exact
ordering, forwarding, cancellation and error logic deterministically. ``FakeOffloader`` and
``RecordingStreams`` are public in :mod:`tba.testing`; ``bare_engine`` reaches into the cache's
transfer engine and stays with the tests."""

from __future__ import annotations

from typing import Any

import torch

from tba.testing import FakeOffloader, RecordingStreams

__all__ = ["FakeOffloader", "RecordingStreams", "bare_engine"]


def bare_engine(offloader: Any, saved: torch.Tensor) -> tuple[Any, Any]:
    """A transfer engine alone (no cache, real stream layer) and one offloadable entry for
    ``saved``, holding its one reference: for tests that drive the engine's calls directly."""
    from tba.cache.entries import Entry
    from tba.cache.streams import DeviceStreams
    from tba.cache.trace import TraceRecorder
    from tba.cache.transfers import Transfers

    engine = Transfers(offloader, DeviceStreams(), num_store_threads=1, num_load_threads=1,
                       max_inflight_bytes=1 << 30, on_io_error="raise", trace=TraceRecorder())
    storage = saved.untyped_storage()
    entry = Entry(1, 1, saved, storage, storage.nbytes(), True, None)
    entry.refs = 1
    return engine, entry
