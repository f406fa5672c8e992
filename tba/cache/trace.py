"""Chrome-trace recording of pack, store, load and stall events (for Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["TraceRecorder"]

_MAX_EVENTS_PER_STEP = 1_000_000


class TraceRecorder:
    """Collects the events of the running step and keeps those of the last completed one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._last: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}

    def _add(self, event: dict[str, Any]) -> None:
        thread = threading.current_thread()
        event["pid"] = os.getpid()
        event["tid"] = thread.ident
        with self._lock:
            self._threads.setdefault(thread.ident or 0, thread.name)
            if len(self._events) < _MAX_EVENTS_PER_STEP:
                self._events.append(event)

    def span(self, name: str, start: float, end: float, **args: Any) -> None:
        """A complete event from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        self._add({"name": name, "cat": "tba", "ph": "X", "ts": (start - self._origin) * 1e6,
                   "dur": (end - start) * 1e6, "args": args})

    def instant(self, name: str, **args: Any) -> None:
        self._add({"name": name, "cat": "tba", "ph": "i", "s": "t",
                   "ts": (time.perf_counter() - self._origin) * 1e6, "args": args})

    def end_step(self) -> None:
        with self._lock:
            self._last, self._events = self._events, []

    def export(self, path: str | os.PathLike) -> int:
        """Write the last completed step (or the running one, before any completed) as
        Chrome-trace JSON; returns the number of events written."""
        with self._lock:
            events = list(self._last or self._events)
            threads = dict(self._threads)
        meta = [
            {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": name}}
            for tid, name in threads.items()
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        return len(events)
