"""Ctrl-C at every line tba runs (Note [Interrupt-safe bookkeeping]): a helper that sends SIGINT
to the process when the training thread reaches the k-th line event of tba's own code.

``signal.raise_signal`` is a real SIGINT: Python runs the process's handler (tba's, which holds
the interrupt back inside a critical section) at its next check, exactly as for a Ctrl-C
typed at that moment. ``sys.settrace`` sees the calling thread only, which is also the only
thread a KeyboardInterrupt can reach.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tba

TBA_DIR = os.path.dirname(os.path.abspath(tba.__file__)) + os.sep


class LineCounter:
    """A trace function counting line events in tba's code; at line ``fire_at`` (1-based) it
    raises SIGINT once and records where."""

    def __init__(self, fire_at: int | None = None) -> None:
        self.fire_at = fire_at
        self.count = 0
        self.fired_at: str | None = None
        self.functions: set[str] = set()  # "path:function" of tba's code that ran (relative)

    def _local(self, frame: Any, event: str, arg: Any) -> Callable | None:
        if self.fired_at is not None:
            return None  # the rest of the step runs untraced
        if event == "line":
            self.count += 1
            code = frame.f_code
            self.functions.add(f"{code.co_filename[len(TBA_DIR):]}:{code.co_name}")
            if self.count == self.fire_at:
                code = frame.f_code
                self.fired_at = f"{code.co_filename[len(TBA_DIR):]}:{frame.f_lineno} ({code.co_name})"
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
                return None
        return self._local

    def __call__(self, frame: Any, event: str, arg: Any) -> Callable | None:
        if frame.f_code.co_filename.startswith(TBA_DIR):
            return self._local
        return None


@contextmanager
def tracing(counter: LineCounter) -> Iterator[LineCounter]:
    previous = sys.gettrace()
    sys.settrace(counter)
    try:
        yield counter
    finally:
        sys.settrace(previous)
