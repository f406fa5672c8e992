"""Chrome-trace recording of pack, store, load and stall events (for Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time

from tba.settings import MAX_TRACE_EVENTS_PER_STEP

__all__ = ["TraceRecorder"]

class TraceRecorder:
    """Collects the events of the running step and keeps those of the last completed one.

    Recording is on the transfer hot path (every store and load), so an event is kept as a
    tuple appended to a list (atomic under the GIL, no lock) and turned into Chrome-trace JSON
    only by ``export``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        # (name, start, end, thread id, bytes, ok)
        self._events: list[tuple[str, float, float, int, int, bool]] = []
        self._last: list[tuple[str, float, float, int, int, bool]] = []
        self._threads: dict[int, str] = {}

    def span(self, name: str, start: float, end: float, nbytes: int, ok: bool = True) -> None:
        """A complete event from ``start`` to ``end`` (``time.perf_counter`` seconds) that
        moved (or waited for) ``nbytes``; ``ok`` is False for a failed transfer."""
        tid = threading.get_ident()
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        events = self._events
        if len(events) < MAX_TRACE_EVENTS_PER_STEP:
            events.append((name, start, end, tid, nbytes, ok))

    def end_step(self) -> None:
        with self._lock:
            self._last, self._events = self._events, []

    def export(self, path: str | os.PathLike[str]) -> int:
        """Write the last completed step (or the running one, before any completed) as
        Chrome-trace JSON; returns the number of events written."""
        with self._lock:
            recorded = list(self._last or self._events)
            threads = dict(self._threads)
        pid = os.getpid()
        meta = [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in threads.items()
        ]
        events = [
            {"name": name, "cat": "tba", "ph": "X", "pid": pid, "tid": tid,
             "ts": (start - self._origin) * 1e6, "dur": (end - start) * 1e6,
             "args": {"bytes": nbytes} if name == "stall" else {"bytes": nbytes, "ok": ok}}
            for name, start, end, tid, nbytes, ok in recorded
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        return len(events)
