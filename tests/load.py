"""A pytest plugin that keeps every core busy while the tests run, to find tests that pass only
when tba's worker threads get a core in time (docs/testing.md, "Tests under load").

    bash .ci/dev.sh load                                     # the CI guard: -m timing under load
    .venv/bin/python -m pytest -p tests.load -m timing       # the same, in a set-up checkout
    .venv/bin/python -m pytest -p tests.load tests/cache     # any selection

At the start of the session it starts ``TBA_LOAD_PROCS`` processes (default: as many as the
cores this process may run on) that spin in a loop at the tests' own priority, and stops them at
the end; each also ends by itself when its parent is gone, so a killed session leaves none
behind. The terminal summary gives the load average at start and end.

On a busy machine a store may not have started when backward needs its tensor: backward then
takes the tensor from memory and cancels the store. A test that asserts bytes moved, counts of
stores or loads, or a decision measured from completed stores must make the transfers certain
first (``cache.wait_for_stores``, ``run_twins(settle=True)``, ``check_parity``); one that does not
fails here where it would pass on a quiet machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

# Spins while its parent, the pytest process whose pid it is given, lives: os.getppid() changes
# when it dies. (Read in the child, the parent's pid could already be its reaper's.)
_SPIN = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n    pass\n"

_procs: list[subprocess.Popen[bytes]] = []
_loadavg: dict[str, str] = {}


def num_procs() -> int:
    """``TBA_LOAD_PROCS``, or the cores this process may run on."""
    text = os.environ.get("TBA_LOAD_PROCS", "")
    if text:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise pytest.UsageError(
                f"tests.load: TBA_LOAD_PROCS={text!r} is not a count of processes; set a whole "
                "number >= 0 (0 runs without injected load)"
            )
        return value
    return len(os.sched_getaffinity(0))


def _loadavg_now() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pytest_configure(config: Any) -> None:
    # Under xdist only the controller starts the load: workers would multiply it.
    if hasattr(config, "workerinput"):
        return
    for _ in range(num_procs()):
        _procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL))
    _loadavg["start"] = _loadavg_now()


def pytest_unconfigure(config: Any) -> None:
    for proc in _procs:
        proc.terminate()
    for proc in _procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    _procs.clear()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _loadavg:
        terminalreporter.write_line(
            f"tests.load: {len(_procs)} busy processes; load average (1, 5, 15 min) at start "
            f"{_loadavg['start']}, at end {_loadavg_now()}"
        )
