"""The SSD offloader's directory goes away on close, at exit and on SIGTERM/SIGINT, and nowhere else."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tba.offloaders.ssd import SSDOffloader
from tba.offloaders.ssd import _lifecycle
from tests.offloaders.ssd_helpers import kill_group, run_python, start_python

_BUILD = """
import os, signal, sys, time, torch
from tba.offloaders.ssd import SSDOffloader
off = SSDOffloader(dirs=[{parent!r}], engine="posix", slab_bytes=1 << 20)
token = off.store(torch.arange(200_000, dtype=torch.int64).view(torch.uint8))
"""


def _wait_for_directory(child) -> str:
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line:
        kill_group(child)
        pytest.fail(f"child did not start: {child.stderr.read() if child.stderr else ''}")
    assert os.path.isdir(line)
    return line


def test_installed_at_construction_and_restored_on_close(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    first = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    second = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    assert signal.getsignal(signal.SIGTERM) is _lifecycle._on_signal
    first.close()
    assert signal.getsignal(signal.SIGTERM) is _lifecycle._on_signal  # second still needs it
    second.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_import_installs_nothing(tmp_path: Path) -> None:
    code = """
        import signal, sys
        import tba.offloaders.ssd
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert "kvikio" not in sys.modules
        print("clean")
        """
    assert run_python(code, cwd=tmp_path).stdout.strip() == "clean"


def test_directory_removed_at_exit_without_close(tmp_path: Path) -> None:
    result = run_python(_BUILD.format(parent=str(tmp_path)) + "print(off.directories[0])\n", cwd=tmp_path)
    directory = result.stdout.strip()
    assert directory and not os.path.exists(directory)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_removes_directory_and_still_kills(tmp_path: Path) -> None:
    child = start_python(
        _BUILD.format(parent=str(tmp_path)) + "print(off.directories[0], flush=True)\ntime.sleep(60)\n", cwd=tmp_path
    )
    try:
        directory = _wait_for_directory(child)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM  # default action chained
    finally:
        kill_group(child)
    assert not os.path.exists(directory)


def test_sigterm_chains_to_the_previous_handler(tmp_path: Path) -> None:
    code = (
        "import signal, sys\n"
        "def mine(signum, frame):\n"
        "    print('user handler ran', flush=True)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        + _BUILD.format(parent=str(tmp_path))
        + "print(off.directories[0], flush=True)\ntime.sleep(60)\n"
    )
    child = start_python(code, cwd=tmp_path)
    try:
        directory = _wait_for_directory(child)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 3
        assert child.stdout is not None and "user handler ran" in child.stdout.read()
    finally:
        kill_group(child)
    assert not os.path.exists(directory)


def test_sigint_removes_directory(tmp_path: Path) -> None:
    child = start_python(
        _BUILD.format(parent=str(tmp_path)) + "print(off.directories[0], flush=True)\ntime.sleep(60)\n", cwd=tmp_path
    )
    try:
        directory = _wait_for_directory(child)
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) != 0
        assert child.stderr is not None and "KeyboardInterrupt" in child.stderr.read()
    finally:
        kill_group(child)
    assert not os.path.exists(directory)


def test_forked_child_never_removes_the_parents_directory(tmp_path: Path) -> None:
    code = _BUILD.format(parent=str(tmp_path)) + (
        "for how in ('exit', 'sigterm'):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        if how == 'sigterm':\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            time.sleep(10)\n"
        "        sys.exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    assert os.path.isdir(off.directories[0]), how\n"
        "    out = torch.empty(1_600_000, dtype=torch.uint8)\n"
        "    off.load(token, out)\n"
        "    assert torch.equal(out.view(torch.int64), torch.arange(200_000)), how\n"
        "off.close()\n"
        "print('ok')\n"
    )
    assert run_python(code, cwd=tmp_path).stdout.strip() == "ok"
    assert list(tmp_path.iterdir()) == []


def test_unclosed_offloader_is_collected_with_its_directory_fds_and_threads(tmp_path: Path) -> None:
    import gc
    import threading

    import torch

    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    threads_before, fds_before = set(threading.enumerate()), fds()
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20, chunk_bytes=64 << 10)
    token = off.store(torch.zeros(1 << 20, dtype=torch.uint8))  # a slab, staging, I/O threads
    directory = off.directories[0]
    own_threads = set(threading.enumerate()) - threads_before
    assert own_threads and os.path.isdir(directory) and len(fds() - fds_before) >= 3
    off.cycle = off  # only the cyclic garbage collector can free it
    off.token = token
    registered = len(_lifecycle._entries)
    del off, token
    gc.collect()
    assert not os.path.exists(directory)
    assert list(tmp_path.iterdir()) == []
    assert not any(t.is_alive() for t in own_threads)
    assert fds() - fds_before == set()
    assert len(_lifecycle._entries) == registered - 1


def test_sigint_handler_is_left_to_python(tmp_path: Path) -> None:
    off = SSDOffloader(dirs=(tmp_path,), engine="posix")
    try:
        # A caught KeyboardInterrupt must not close the offloader: no handler of ours on SIGINT.
        assert signal.getsignal(signal.SIGINT) is not _lifecycle._on_signal
    finally:
        off.close()
