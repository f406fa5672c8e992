"""The ``tests.load`` pytest plugin (tests/load.py): busy processes for the session, gone after it
or when the session is killed, and a bad ``TBA_LOAD_PROCS`` refused with a message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]

# The plugin is loaded as the top-level module ``load`` (PYTHONPATH=tests/): the sessions here
# then import neither torch nor tba (the ``tests`` package does), which keeps them fast.
INNER = """
import os
import load

def test_busy_processes_run_during_the_session():
    procs = load._procs
    assert len(procs) == int(os.environ["TBA_LOAD_PROCS"])
    assert all(p.poll() is None for p in procs)
    with open(os.environ["PIDS_FILE"], "w") as f:
        f.write(" ".join(str(p.pid) for p in procs))
"""


def _alive(pid: int) -> bool:
    # A process that ended but was not reaped yet is a zombie: gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The ``pids`` still running after ``timeout_s`` (polled; empty as soon as all ended)."""
    wait_until(lambda: not any(_alive(p) for p in pids), timeout_s, interval_s=0.05)
    return [p for p in pids if _alive(p)]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests"), **extra}


def test_busy_processes_run_for_the_session_and_end_with_it(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "load", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=_env(TBA_LOAD_PROCS="2", PIDS_FILE=str(pids_file)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tests.load: 2 busy processes; load average (1, 5, 15 min) at start" in proc.stdout
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and not _wait_gone(pids)


def test_busy_processes_end_when_the_session_is_killed(tmp_path: Path) -> None:
    code = "import load, time\nload.pytest_configure(object())\n" \
           "print(' '.join(str(p.pid) for p in load._procs), flush=True)\ntime.sleep(300)\n"
    session = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=_env(TBA_LOAD_PROCS="1"))
    try:
        assert session.stdout is not None
        pids = [int(p) for p in session.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
    finally:
        session.send_signal(signal.SIGKILL)  # no unconfigure: the children must notice by themselves
        session.wait(timeout=30)
    assert not _wait_gone(pids), "a busy process outlived its session"


def test_a_bad_process_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import load

    monkeypatch.setenv("TBA_LOAD_PROCS", "two")
    with pytest.raises(pytest.UsageError, match="TBA_LOAD_PROCS='two' is not a count of processes"):
        load.num_procs()
    monkeypatch.setenv("TBA_LOAD_PROCS", "0")
    assert load.num_procs() == 0
    monkeypatch.delenv("TBA_LOAD_PROCS")
    assert load.num_procs() == len(os.sched_getaffinity(0))
