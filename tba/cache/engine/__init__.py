"""The engine: one owner of entry life (Note [One owner of entry life] in core.py).

Owns the entries of saved storages and their handles, the entry state machine, the transfers
and the worker threads that run them, the counters, the stream/event layer (``streams.py``)
and the guard of its one lock against signal handlers (``interrupts.py``: Note
[Interrupt-safe bookkeeping]).

May import from ``tba.cache``: ``tba.cache.observe``.
May import from outside it: ``tba.offloaders``, ``tba.errors``, ``tba.settings``,
``tba.malloc_hook``, ``tba._torch_compat``.
Not the capture side (``capture``, ``steps``), ``policy`` or ``tensor_cache``, not even for
types: the scopes and records the engine holds for the capture are ``Protocol`` types here
(``entries.SavedScope``, ``entries.SavedRecord``).
"""

from tba.cache.engine.core import Engine
from tba.cache.engine.entries import Entry, Handle, HandleRef, Transfer
from tba.cache.engine.states import HOLDS, HOLDS_DATA, TRANSITIONS, Event, State

__all__ = [
    "Engine", "Entry", "Handle", "HandleRef", "Transfer", "State", "Event", "HOLDS",
    "HOLDS_DATA", "TRANSITIONS",
]
