"""A signal at every line tba runs (Note [Interrupt-safe bookkeeping]): a helper that sends
SIGINT (or another signal) to the process when the training thread reaches the k-th line event
of tba's own code.

``signal.raise_signal`` is a real signal: Python runs the process's handler (wrapped by tba,
which holds it back inside a critical section) at its next check, exactly as for a Ctrl-C
typed, or a timer that expired, at that moment. ``sys.settrace`` sees the calling thread only,
which is also the only thread a signal handler runs on.
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


class Timeout(Exception):
    """What a script's SIGALRM handler raises (a timeout the training loop catches)."""


def raise_timeout(signum: int, frame: Any) -> None:
    raise Timeout(f"signal {signum}")


class LineCounter:
    """A trace function counting line events in tba's code; at line ``fire_at`` (1-based) it
    sends ``signum`` once and records where."""

    def __init__(self, fire_at: int | None = None, signum: int = signal.SIGINT) -> None:
        self.fire_at = fire_at
        self.signum = signum
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
                signal.raise_signal(self.signum)
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
