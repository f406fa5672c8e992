"""The engine: one owner of entry life (Note [One owner of entry life] in core.py)."""

from tba.cache.engine.core import Engine
from tba.cache.engine.entries import Entry, Handle, HandleRef, Transfer
from tba.cache.engine.states import HOLDS, HOLDS_DATA, TRANSITIONS, Event, State

__all__ = [
    "Engine", "Entry", "Handle", "HandleRef", "Transfer", "State", "Event", "HOLDS",
    "HOLDS_DATA", "TRANSITIONS",
]
