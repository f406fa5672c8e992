"""Ctrl-C while tba updates its bookkeeping: held back until the update is whole.

Note [Interrupt-safe bookkeeping]: a ``KeyboardInterrupt`` (Ctrl-C: SIGINT; in a notebook the
usual way to stop a cell and go on) is raised in the main thread at whatever bytecode it is
running when the signal is handled. Landing between two statements of a paired update (an
entry's state and the counters that sum the states; an allocator's free list and its sizes)
it would leave them disagreeing for good: leaked entries and extents, negative counters, a
forward waiting forever for room that was never given back. Landing in a destructor it is
printed and discarded by Python, so the script never sees it.

tba therefore changes shared state only inside *critical sections*: while the main thread
holds a guarded lock (the cache's one lock, ``guard``). tba's SIGINT handler (installed by the
first cache, over Python's default handler only, and put back when the last cache closes)
raises at once when the main thread holds no guarded lock, and otherwise records the signal
(``pending``) and returns, so the section runs to its end. Every tba entry point that takes the
lock (the pack and unpack hooks, the module and grad_fn hooks, the end-of-backward callback, the
cache's public calls) calls ``raise_pending`` once it let go of the lock: the interrupt is
raised there, in the training step, never lost. Waits (backpressure, a load, stores to finish)
release the lock while they wait, so Ctrl-C ends them at once.

Handles die in autograd's C++ code and in the garbage collector; tba learns of it through a
weak reference whose callback is ``deque.append`` (C code: no Python frame in which a signal
could be handled or an exception discarded), and does the release at its next entry point,
inside a critical section. Tested by tests/cache/test_interrupts.py, which raises SIGINT at
every line tba runs in a few training steps.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType

__all__ = ["guard", "unguard", "raise_pending", "pending", "install", "interrupt_count"]

logger = logging.getLogger(__name__)

#: A SIGINT arrived during a critical section and waits to be raised (main thread only).
pending = False
#: KeyboardInterrupts tba's handler let through or raised late: a forward that was running
#: when one of them was raised may have been abandoned (Note [Interrupted forwards]).
interrupt_count = 0

_state_lock = threading.Lock()
_locks: tuple[weakref.ref[threading.RLock], ...] = ()  # guarded locks (published whole: read by the handler)
# The handler tba's replaced (Python's default_int_handler).
_previous: Callable[[int, FrameType | None], object] | int | None = None


def _handler(signum: int, frame: FrameType | None) -> None:
    """tba's SIGINT handler: hold the interrupt back while the main thread is inside a critical
    section, else hand it to the handler tba replaced."""
    global pending, interrupt_count
    for ref in _locks:
        lock = ref()
        # typeshed omits RLock._is_owned (CPython's RLock has it, in C and in Python).
        if lock is not None and lock._is_owned():  # type: ignore[attr-defined]
            pending = True
            return
    interrupt_count += 1
    previous = _previous if callable(_previous) else signal.default_int_handler
    previous(signum, frame)


def raise_pending() -> None:
    """Raise the interrupt held back by a critical section (call with no guarded lock held,
    on the thread that may have been interrupted: a no-op on other threads)."""
    global pending, interrupt_count
    if pending and threading.current_thread() is threading.main_thread():
        pending = False
        interrupt_count += 1
        previous = _previous if callable(_previous) else signal.default_int_handler
        previous(signal.SIGINT, None)


def install() -> None:
    """Put tba's handler in front of Python's default SIGINT handler (main thread only; a
    handler the script installed itself, or an ignored/default SIGINT, is left alone). Cheap
    when it is already installed: called at every forward of a configured model, because
    notebook kernels put the default handler back around each cell."""
    global _previous
    if not _locks or threading.current_thread() is not threading.main_thread():
        return
    try:
        current = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - no signal support
        return
    if current is _handler or current is not signal.default_int_handler:
        return
    _previous = current
    try:
        signal.signal(signal.SIGINT, _handler)
    except (ValueError, OSError):  # pragma: no cover - not the main interpreter
        return
    logger.debug("tba: SIGINT is held back during tba's critical sections")


def guard(lock: threading.RLock) -> None:
    """Make ``lock`` (an ``RLock``: its owner must be known) a critical section for SIGINT."""
    global _locks
    with _state_lock:
        _locks = tuple(r for r in _locks if r() is not None) + (weakref.ref(lock),)
    install()


def unguard(lock: threading.RLock) -> None:
    """Forget ``lock``; the last one gone puts Python's default handler back (if tba's is
    still the one installed)."""
    global _locks
    with _state_lock:
        _locks = tuple(r for r in _locks if r() is not None and r() is not lock)
        last = not _locks
    if last and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGINT) is _handler:
                signal.signal(signal.SIGINT, _previous or signal.default_int_handler)
        except (ValueError, OSError):  # pragma: no cover
            pass
