"""Removes SSD offloader directories when the process ends: at exit and on SIGTERM/SIGINT.

One process-wide registry of cleanup callbacks. The ``atexit`` hook and the signal handlers are
installed when the first offloader registers (never at import) and the signal handlers are put
back when the last one unregisters.

Note [Signals that do not end the process]: a handler is installed only for a signal whose
current disposition is ``SIG_DFL``, i.e. one that would kill the process without running
``atexit``; it removes the directories and dies by the signal again. A signal with a Python
handler (SIGINT's ``default_int_handler``, a training script's SIGTERM handler that saves a
checkpoint) is left to that handler: it may raise ``KeyboardInterrupt`` that a notebook catches,
or let training finish, and the offloader must stay usable; if the process does end, it ends
through ``atexit`` (uncaught exception, ``sys.exit``), which removes the directories.

The registry holds callbacks of ``_Resources`` objects, never an offloader, so an offloader that
is dropped without ``close()`` is still collected; its ``weakref.finalize`` closes it and
unregisters the callback.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["register", "unregister"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Re-entrant: a signal handler runs on the main thread, possibly while that thread is inside
# register/unregister holding the lock.
_lock = threading.RLock()
_ids = itertools.count()
# id -> (pid of the registering process, callback). A forked child inherits this dict; the pid
# keeps a child from removing its parent's directories.
_entries: dict[int, tuple[int, Callable[[], None]]] = {}
_previous: dict[int, Any] = {}
_installed: set[int] = set()
_atexit_registered = False


def register(cleanup: Callable[[], None]) -> int:
    """Run ``cleanup`` at interpreter exit or on SIGTERM/SIGINT, unless unregistered first.

    ``cleanup`` must be quick, idempotent, and take no lock another thread may hold.
    Returns a handle for :func:`unregister`.
    """
    global _atexit_registered
    with _lock:
        handle = next(_ids)
        _entries[handle] = (os.getpid(), cleanup)
        if not _atexit_registered:
            atexit.register(_run_all)
            _atexit_registered = True
        _install_signal_handlers()
        return handle


def unregister(handle: int) -> None:
    """Forget a callback; when none is left, put the previous signal handlers back."""
    with _lock:
        _entries.pop(handle, None)
        if not any(pid == os.getpid() for pid, _ in _entries.values()):
            _restore_signal_handlers()


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        logger.debug("SSD offloader built off the main thread: no SIGTERM/SIGINT cleanup handler")
        return
    for signum in _SIGNALS:
        if signum in _installed:
            continue
        current = signal.getsignal(signum)
        if current is not signal.SIG_DFL:
            # Ignored, handled in Python, or set outside Python (None): not ours to take over;
            # see Note [Signals that do not end the process].
            continue
        _previous[signum] = current
        signal.signal(signum, _on_signal)
        _installed.add(signum)


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in list(_installed):
        # Someone installed a handler on top of ours: leave theirs; ours stays in their chain
        # and only forwards from now on.
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, _previous[signum])
        _installed.discard(signum)


def _run_all() -> None:
    """Run every callback this process registered; errors are logged, never raised."""
    with _lock:
        callbacks = [cb for pid, cb in _entries.values() if pid == os.getpid()]
    for callback in callbacks:
        try:
            callback()
        except Exception:  # noqa: BLE001 - exit path: report and go on with the next directory
            logger.exception("tba: cleaning up an SSD offloader directory failed")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Installed only over ``SIG_DFL``: clean up, then die the way the signal would have killed
    us (exit status, core dump policy)."""
    _run_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
