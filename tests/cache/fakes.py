"""Controllable fakes for the offloader and stream layer, so CPU tests drive the exact
ordering, forwarding, cancellation and error logic deterministically. ``FakeOffloader`` and
``RecordingStreams`` are public in :mod:`tba.testing`; ``bare_engine`` reaches into the cache's
transfer engine and stays with the tests."""

from __future__ import annotations

from typing import Any

import torch

from tba.testing import FakeOffloader, RecordingStreams

__all__ = ["FakeOffloader", "RecordingStreams", "bare_engine"]


def bare_engine(offloader: Any, saved: torch.Tensor, **options: Any) -> tuple[Any, Any]:
    """A transfer engine alone (no cache, real stream layer) and a handle of ``saved`` saved
    into it for offload (the handle holds its entry's one reference), as at the end of the unit
    that saved it: for tests that drive the engine's calls directly. Drop the handle and call ``engine.drain()`` to release it."""
    from tba.cache.engine import Engine
    from tba.cache.engine.streams import DeviceStreams
    from tba.cache.observe.trace import TraceRecorder
    from tba.cache.steps.scopes import Record, Scope

    settings: dict[str, Any] = dict(
        num_store_threads=1, num_load_threads=1, max_inflight_bytes=1 << 30, min_offload_bytes=0,
        on_io_error="raise", timeout_s=30.0,
    )
    settings.update(options)
    engine = Engine(offloader, DeviceStreams(), trace=TraceRecorder(), **settings)
    record = Record((-1, 0), keep_tail=True)
    scope = Scope(record, 0, None, keep=False)
    record.scopes.append(scope)
    handle = engine.save(saved, saved.untyped_storage(), saved, scope, record, True)
    engine.flush()  # the unit that saved it ends: its batch, if any, is stored
    return engine, handle
