"""Signal handlers of the script's own while tba updates its bookkeeping (Note [Interrupt-safe
bookkeeping]): wrapped while a cache exists, held back inside a critical section, run with
their frame and in order at the next entry point, put back when the last cache closes. The
sweeps of tests/cache/test_interrupts.py drive SIGINT and a raising SIGALRM handler at every
line; here the mechanism itself, and timeouts at random moments in a real training loop."""

from __future__ import annotations

import gc
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

import tba
from tba.cache.engine import interrupts
from tba.testing import probe
from tests import models
from tests.offloaders.ssd_helpers import run_python

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture
def handlers() -> Iterator[None]:
    """Put SIGUSR1, SIGUSR2, SIGALRM and SIGTERM back as they were."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
                                              signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_handlers_are_wrapped_while_a_cache_exists(handlers: None) -> None:
    calls: list[int] = []

    def before(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    def later(signum: int, frame: FrameType | None) -> None:
        calls.append(-signum)

    signal.signal(signal.SIGUSR1, before)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    gc.collect()  # no cache of an earlier test is left
    model = models.Stack(num_blocks=2, width=16)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0):
        wrapper = signal.getsignal(signal.SIGUSR1)
        assert isinstance(wrapper, interrupts._Deferring) and wrapper.handler is before
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN  # not a Python handler
        signal.signal(signal.SIGUSR2, later)  # installed while the cache exists ...
        assert signal.getsignal(signal.SIGUSR2) is later
        model(models.vector_batch(0)).backward()  # ... is wrapped at the next forward
        assert isinstance(signal.getsignal(signal.SIGUSR2), interrupts._Deferring)
        signal.raise_signal(signal.SIGUSR1)  # outside a critical section: runs at once
        assert calls == [signal.SIGUSR1]
    gc.collect()
    assert signal.getsignal(signal.SIGUSR1) is before and signal.getsignal(signal.SIGUSR2) is later


def test_tbas_own_cleanup_handler_is_left_alone(handlers: None, tmp_path: Path) -> None:
    # The SSD offloader's SIGTERM handler (installed over SIG_DFL) removes its directories and
    # ends the process: nothing to hold back, and the offloader puts SIG_DFL back itself.
    from tba.offloaders.ssd import _lifecycle

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.collect()
    model = models.Stack(num_blocks=2, width=16)
    with tba.configure_tensor_cache(model, offloader="ssd", ssd_dirs=(str(tmp_path),),
                                    offload_devices=("cpu",), min_offload_bytes=0):
        model(models.vector_batch(0)).backward()
        assert signal.getsignal(signal.SIGTERM) is _lifecycle._on_signal
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_waits_for_the_critical_section_and_runs_with_its_frame(handlers: None) -> None:
    seen: list[tuple[int, str | None]] = []

    class Timeout(Exception):
        pass

    def record(signum: int, frame: FrameType | None) -> None:
        seen.append((signum, frame.f_code.co_name if frame is not None else None))

    def timeout(signum: int, frame: FrameType | None) -> None:
        raise Timeout

    signal.signal(signal.SIGUSR1, record)
    signal.signal(signal.SIGALRM, timeout)
    model = models.Stack(num_blocks=2, width=16)
    with tba.configure_tensor_cache(model, offload_devices=("cpu",), min_offload_bytes=0) as cache:
        lock = cache._engine.lock  # holding it is being inside a critical section
        count = interrupts.interrupt_count

        def inside_the_section() -> None:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGALRM)
            assert interrupts.pending and not seen  # held back: the update runs to its end

        with lock:
            inside_the_section()
            interrupts.raise_pending()  # inside a section: nothing runs
            assert interrupts.pending and not seen
        with pytest.raises(Timeout):
            interrupts.raise_pending()  # at the entry point: in order, with their frames
        assert seen == [(signal.SIGUSR1, "inside_the_section")]
        assert not interrupts.pending and interrupts.interrupt_count == count + 1
        model(models.vector_batch(0)).backward()  # the cache trains on
        assert not probe(cache).check_invariants()


_RANDOM_TIMEOUTS = """
import gc, json, os, random, signal, sys, tempfile, time
sys.path.insert(0, {root!r})
import torch
import tba
from tba.testing import probe
from tests import models

class Timeout(Exception):
    pass

def on_alarm(signum, frame):
    raise Timeout()

mode = {mode!r}
rng = random.Random(0)
torch.manual_seed(0)
model = models.Stack(num_blocks=3, width=64)
options = dict(offloader=mode, offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0,
               adaptive=False, transfer_timeout_s=20)
if mode == "ssd":
    options.update(ssd_dirs=({tmp!r},), ssd_engine="posix")
cache = tba.configure_tensor_cache(model, **options)
signal.signal(signal.SIGALRM, on_alarm)
start = time.perf_counter()
model(models.vector_batch(0)).backward()
step_s = time.perf_counter() - start
timeouts = steps = 0
while timeouts < {num_timeouts}:
    # The alarm may also land after the step, up to the line that cancels it (a busy machine
    # gets there late): the outer try catches it wherever it lands, and a one-shot timer
    # cannot fire again once the handler has run or the timer is cancelled.
    try:
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, 1.2) * step_s)
        try:
            model(models.vector_batch(steps)).backward()
            steps += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Timeout:
        timeouts += 1
    model.zero_grad()
gc.collect()
model(models.vector_batch(99)).backward()  # raises TBAError if the bookkeeping broke
view = probe(cache)
view.wait_idle(20)
print(json.dumps({{"timeouts": timeouts, "entries": view.num_entries,
                   "problems": view.check_invariants(), "pool": getattr(cache.offloader, "used_bytes", 0)}}))
cache.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["host", "ssd"])
def test_timeouts_at_random_moments_leave_the_cache_usable(mode: str, tmp_path: Path) -> None:
    # The script, bounded: 30 timeouts at random moments of the steps (a SIGALRM
    # handler that raises), caught by the loop, which trains on. Where they land varies from
    # run to run; the result must not: no error, nothing held, no hang (the child is killed
    # and the test fails after 120 s).
    root = str(Path(__file__).resolve().parents[2])
    code = _RANDOM_TIMEOUTS.format(root=root, mode=mode, tmp=str(tmp_path), num_timeouts=30)
    result = run_python(code, cwd=tmp_path, timeout_s=120)
    report = json.loads(result.stdout.splitlines()[-1])
    assert report == {"timeouts": 30, "entries": 0, "problems": [], "pool": 0}, (report, result.stderr[-2000:])
