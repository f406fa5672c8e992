"""Signal handlers while tba updates its bookkeeping: held back until the update is whole.

Note [Interrupt-safe bookkeeping]: Python runs a signal's Python-level handler on the main
thread, between two bytecodes of whatever that thread runs when the signal is handled. If the
handler raises (Ctrl-C: SIGINT's default handler raises ``KeyboardInterrupt``, in a notebook
the usual way to stop a cell and go on; a timeout: a SIGALRM handler that raises, caught by a
training loop that goes on), the exception lands there. Landing between two statements of a
paired update (an entry's state and the counters that sum the states; an allocator's free list
and its sizes) it would leave them disagreeing for good: leaked entries and extents, negative
counters, a forward waiting forever for room that was never given back. Landing in a
destructor it is printed and discarded by Python, so the script never sees it.

tba therefore changes shared state only inside *critical sections*: while the main thread
holds a guarded lock (the cache's one lock, ``guard``). While a cache exists, every
Python-level signal handler is wrapped (``install``, run by the first cache and again at every
forward of a configured model, so a handler the script installs later is wrapped at its next
forward; put back when the last cache closes). The wrapper runs the handler at once when the
main thread holds no guarded lock, and otherwise records it (``pending``) and returns, so the
section runs to its end. Every tba entry point that takes the lock (the pack and unpack hooks,
the module and grad_fn hooks, the end-of-backward callback, the cache's public calls) calls
``raise_pending`` once it let go of the lock: the handlers held back run there, on the main
thread, in the order their signals came, with the frames they were called with; what they
raise is raised in the training step, never lost. A section holds a handler back for as long
as it runs, which is short: waits (backpressure, a load, stores to finish) release the lock
while they wait, so a signal ends them at once. Only inline transfers (Note [Small transfers
inline]) do I/O under the lock.

Left alone: signals whose disposition is not a Python callable (``SIG_DFL``, ``SIG_IGN``, a
handler installed from C), and tba's own handlers (the SSD cleanup handler ends the process).
A handler installed while a forward runs is wrapped at the next forward. While a cache exists,
``signal.getsignal`` returns the wrapper; its ``handler`` attribute is the script's handler.

Handles die in autograd's C++ code and in the garbage collector; tba learns of it through a
weak reference whose callback is ``deque.append`` (C code: no Python frame in which a signal
could be handled or an exception discarded), and does the release at its next entry point,
inside a critical section. Tested by tests/cache/test_interrupts.py, which raises SIGINT, and
SIGALRM with a handler that raises, at every line tba runs in a few training steps.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C module: Note [Scanning the handlers]
import collections
import logging
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType

__all__ = ["guard", "unguard", "raise_pending", "pending", "install", "interrupt_count"]

logger = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], object]

#: A handler was held back by a critical section and waits to run (main thread only).
pending = False
#: Exceptions raised by signal handlers tba wrapped, at once or late: a forward that was
#: running when one of them was raised may have been abandoned (Note [Interrupted forwards]).
interrupt_count = 0

_state_lock = threading.Lock()
_locks: tuple[weakref.ref[threading.RLock], ...] = ()  # guarded locks (published whole: read by the handler)
_held: collections.deque[tuple[Handler, int, FrameType | None]] = collections.deque()  # pending handlers
_wrapped: dict[int, _Deferring] = {}  # signal -> the wrapper tba installed
_signals: tuple[int, ...] = ()  # the signals a handler can be installed for (computed once)
_seen: list[object] = []  # their handlers after the last install (Note [Scanning the handlers])
_getsignal: Callable[[int], object] = _signal.getsignal


def _in_critical_section() -> bool:
    for ref in _locks:
        lock = ref()
        # typeshed omits RLock._is_owned (CPython's RLock has it, in C and in Python).
        if lock is not None and lock._is_owned():  # type: ignore[attr-defined]
            return True
    return False


def _run(handler: Handler, signum: int, frame: FrameType | None) -> None:
    global interrupt_count
    try:
        handler(signum, frame)
    except BaseException:
        interrupt_count += 1
        raise


class _Deferring:
    """tba's wrapper of a Python-level signal handler: holds ``handler`` back while the main
    thread is inside a critical section, else runs it."""

    __slots__ = ("signum", "handler")

    def __init__(self, signum: int, handler: Handler) -> None:
        self.signum = signum
        self.handler = handler

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        global pending
        if _in_critical_section():
            _held.append((self.handler, signum, frame))
            pending = True
            return
        _run(self.handler, signum, frame)

    def __repr__(self) -> str:
        return f"<tba: {self.handler!r}, held back during tba's bookkeeping>"


def raise_pending() -> None:
    """Run the handlers held back by a critical section, raising what they raise (call with
    no guarded lock held, on the thread that may have been interrupted: a no-op on other
    threads and inside a critical section)."""
    global pending
    if not pending or threading.current_thread() is not threading.main_thread() or _in_critical_section():
        return
    while _held:
        handler, signum, frame = _held.popleft()
        pending = bool(_held)
        _run(handler, signum, frame)
    pending = False


def _catchable() -> tuple[int, ...]:
    global _signals
    if not _signals:
        _signals = tuple(int(s) for s in signal.valid_signals()
                         if s not in (signal.SIGKILL, signal.SIGSTOP))
    return _signals


def install() -> None:
    """Wrap every Python-level signal handler not wrapped yet (main thread only, while a cache
    exists). Called at every forward of a configured model: a handler the script installed
    since (a timeout around each step), or the default SIGINT handler a notebook kernel puts
    back around each cell, is wrapped before the forward runs."""
    global _seen
    if not _locks or threading.current_thread() is not threading.main_thread():
        return
    # Note [Scanning the handlers]: at every forward, so it must be cheap. ``signal.getsignal``
    # turns SIG_DFL and SIG_IGN into enum members (about 5 us a signal: 0.3 ms for the 60);
    # ``_signal.getsignal`` returns ints and handlers as they are, and the list of all of them
    # is compared with the last one seen (a few us when nothing changed).
    signals = _catchable()
    current = list(map(_getsignal, signals))
    if current == _seen:
        return
    for signum, handler in zip(signals, current):
        if type(handler) is _Deferring or not callable(handler):
            continue
        if str(getattr(handler, "__module__", None) or "").startswith("tba."):
            continue  # tba's own (the SSD cleanup handler ends the process)
        wrapper = _Deferring(signum, handler)
        try:
            signal.signal(signum, wrapper)
        except (ValueError, OSError, RuntimeError):  # pragma: no cover - not the main interpreter
            continue
        _wrapped[signum] = wrapper
        logger.debug("tba: signal %d's handler %r is held back during tba's critical sections",
                     signum, handler)
    _seen = list(map(_getsignal, signals))


def guard(lock: threading.RLock) -> None:
    """Make ``lock`` (an ``RLock``: its owner must be known) a critical section for signal
    handlers."""
    global _locks
    with _state_lock:
        _locks = tuple(r for r in _locks if r() is not None) + (weakref.ref(lock),)
    install()


def unguard(lock: threading.RLock) -> None:
    """Forget ``lock``; the last one gone puts the wrapped handlers back (those still
    installed; from the main thread: elsewhere the wrappers stay, and pass every signal
    through at once)."""
    global _locks
    with _state_lock:
        _locks = tuple(r for r in _locks if r() is not None and r() is not lock)
        last = not _locks
    if not last or threading.current_thread() is not threading.main_thread():
        return
    global _seen
    for signum, wrapper in list(_wrapped.items()):
        try:
            if _getsignal(signum) is wrapper:
                signal.signal(signum, wrapper.handler)
        except (ValueError, OSError, RuntimeError):  # pragma: no cover
            pass
    _wrapped.clear()
    _seen = []
