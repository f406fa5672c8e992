"""The life of an entry as data: its states, the events that move it, and what each changes.

Note [Entry state machine]: every change of an entry's state goes through one table,
``TRANSITIONS``: (state, event) -> (new state, step-counter deltas). What an entry adds to the
engine's three byte counters follows from its state alone (``HOLDS``: resident in memory, in
flight to the offloader, held by the offloader), so a transition changes the counters by
``nbytes * (HOLDS[new] - HOLDS[old])`` and the invariant check (Note [Cache invariants]) sums
``HOLDS`` over the live entries and compares. The engine applies a row with one function
(``Engine._apply``; the two rows of the hot path, KEEP of a new entry and DROP of a kept one,
inline in ``save`` and the release drain, read their deltas from the same table), always under
its lock, a critical section that Ctrl-C cannot split (Note [Interrupt-safe bookkeeping]). A
(state, event) pair missing from the table is a tba bug and raises at once instead of drifting
counters.

States: KEPT (in memory, never offloaded, or its store was cancelled or failed); QUEUED (in
memory, store waiting for a worker); STORING (in memory, store running); STORING_WANTED (the
same, and backward asked for it meanwhile: keep the bytes when the store ends); STORED (only in
the offloader); LOADING (read back running); RELOADED (read back: in memory only, its
offloader space given back: Note [A reloaded entry holds no offloader space]); READY (in memory
and in the offloader: stored while wanted, or saved again by the kept tail); DROPPED (every
handle died);
ORPHAN_STORING / ORPHAN_LOADING (every handle died while a worker was copying it: the worker
finishes, then gives the space back).
"""

from __future__ import annotations

import enum

__all__ = ["State", "Event", "HOLDS", "TRANSITIONS", "HOLDS_DATA", "STAT_FIELDS", "ROWS"]


class State(enum.Enum):
    KEPT = "kept"
    QUEUED = "queued"
    STORING = "storing"
    STORING_WANTED = "storing (wanted)"
    STORED = "stored"
    LOADING = "loading"
    RELOADED = "reloaded"
    READY = "ready"
    DROPPED = "dropped"
    ORPHAN_STORING = "dropped while storing"
    ORPHAN_LOADING = "dropped while loading"

    # Members are singletons: identity hashing is C-level (Enum's own __hash__ is Python code
    # and runs on every state test in the hot path).
    __hash__ = object.__hash__


class Event(enum.Enum):
    KEEP = "keep"  # a new entry that stays in memory
    QUEUE = "queue"  # a new entry whose store goes to the workers
    STORED_BATCH = "stored in a batch"  # its batch was stored on the training thread
    START_STORE = "start store"  # a worker took the store
    CANCEL = "cancel"  # the kept tail saves a queued entry again: keep it, no store
    RESIZED = "resized"  # its storage was resized behind autograd's back: keep it, no store
    WANT = "want"  # backward wants a running store's tensor
    STORE_DONE = "store done"
    STORE_FAILED = "store failed"
    LOAD = "load"
    LOAD_DONE = "load done"
    LOAD_FAILED = "load failed"
    ABANDON = "abandon"  # a queued load that never ran (close, or its entry died first)
    SAVED_AGAIN = "saved again"  # the kept tail saves a stored entry again: its bytes are here
    DROP = "drop"  # its last handle was released

    __hash__ = object.__hash__


S, E = State, Event

#: Bytes an entry in each state adds to (resident, in flight, held by the offloader), in units
#: of its size.
HOLDS: dict[State, tuple[int, int, int]] = {
    S.KEPT: (1, 0, 0),
    S.QUEUED: (1, 1, 0),
    S.STORING: (1, 1, 0),
    S.STORING_WANTED: (1, 1, 0),
    S.STORED: (0, 0, 1),
    S.LOADING: (0, 0, 1),
    S.RELOADED: (1, 0, 0),
    S.READY: (1, 0, 1),
    S.DROPPED: (0, 0, 0),
    S.ORPHAN_STORING: (0, 1, 0),
    S.ORPHAN_LOADING: (0, 0, 1),
}

#: States whose entry holds its bytes in memory (``entry.data``).
HOLDS_DATA = frozenset(s for s, holds in HOLDS.items() if holds[0])

#: The per-step counters (fields of CacheStats) a transition may add to.
STAT_FIELDS = (
    "kept_bytes", "num_cancelled", "num_offloaded", "offloaded_bytes", "reloaded_bytes",
    "num_io_errors", "num_resized",
)

# Deltas of the step counters: (field, in units of nbytes?) -> added 1 or nbytes.
_KEPT = (("kept_bytes", True),)
_CANCELLED = (("num_cancelled", False),) + _KEPT
_OFFLOADED = (("num_offloaded", False), ("offloaded_bytes", True))
_FAILED = (("num_io_errors", False),) + _KEPT
_RESIZED = (("num_resized", False),) + _KEPT

#: (state before, event) -> (state after, step-counter deltas). ``None`` is the state of an
#: entry that does not exist yet.
TRANSITIONS: dict[tuple[State | None, Event], tuple[State, tuple[tuple[str, bool], ...]]] = {
    (None, E.KEEP): (S.KEPT, _KEPT),
    (None, E.QUEUE): (S.QUEUED, ()),
    (S.QUEUED, E.STORED_BATCH): (S.STORED, _OFFLOADED),  # Note [Small transfers in batches]
    (S.QUEUED, E.START_STORE): (S.STORING, ()),
    (S.QUEUED, E.CANCEL): (S.KEPT, _CANCELLED),
    (S.QUEUED, E.WANT): (S.KEPT, _CANCELLED),
    (S.STORING, E.WANT): (S.STORING_WANTED, ()),
    (S.STORING_WANTED, E.WANT): (S.STORING_WANTED, ()),
    (S.STORING, E.STORE_DONE): (S.STORED, _OFFLOADED),
    (S.STORING_WANTED, E.STORE_DONE): (S.READY, _OFFLOADED),
    (S.ORPHAN_STORING, E.STORE_DONE): (S.DROPPED, _OFFLOADED),
    (S.STORING, E.STORE_FAILED): (S.KEPT, _FAILED),
    (S.STORING_WANTED, E.STORE_FAILED): (S.KEPT, _FAILED),
    (S.ORPHAN_STORING, E.STORE_FAILED): (S.DROPPED, (("num_io_errors", False),)),
    # Note [Storages freed behind tba's back]: the store is refused, the tensor kept.
    (S.QUEUED, E.RESIZED): (S.KEPT, _RESIZED),
    (S.STORING, E.RESIZED): (S.KEPT, _RESIZED),
    (S.STORING_WANTED, E.RESIZED): (S.KEPT, _RESIZED),
    (S.ORPHAN_STORING, E.RESIZED): (S.DROPPED, (("num_resized", False),)),
    (S.STORED, E.LOAD): (S.LOADING, ()),
    # Note [A reloaded entry holds no offloader space]: the engine releases the token with it.
    (S.LOADING, E.LOAD_DONE): (S.RELOADED, (("reloaded_bytes", True),)),
    (S.ORPHAN_LOADING, E.LOAD_DONE): (S.DROPPED, ()),
    (S.LOADING, E.LOAD_FAILED): (S.STORED, (("num_io_errors", False),)),
    (S.ORPHAN_LOADING, E.LOAD_FAILED): (S.DROPPED, (("num_io_errors", False),)),
    (S.LOADING, E.ABANDON): (S.STORED, ()),
    (S.ORPHAN_LOADING, E.ABANDON): (S.DROPPED, ()),  # its handles died before the load began
    (S.STORED, E.SAVED_AGAIN): (S.READY, ()),
    (S.KEPT, E.DROP): (S.DROPPED, ()),
    (S.QUEUED, E.DROP): (S.DROPPED, (("num_cancelled", False),)),
    (S.STORING, E.DROP): (S.ORPHAN_STORING, ()),
    (S.STORING_WANTED, E.DROP): (S.ORPHAN_STORING, ()),
    (S.STORED, E.DROP): (S.DROPPED, ()),
    (S.LOADING, E.DROP): (S.ORPHAN_LOADING, ()),
    (S.RELOADED, E.DROP): (S.DROPPED, ()),
    (S.READY, E.DROP): (S.DROPPED, ()),
}


_NONE = (0, 0, 0)

#: ``TRANSITIONS`` compiled for ``Engine._apply``: (state, event) -> (new state, change of the
#: resident, in-flight and held counters in units of the entry's size, step-counter deltas).
ROWS: dict[tuple[State | None, Event], tuple[State, int, int, int, tuple[tuple[str, bool], ...]]] = {
    (old, event): (
        new,
        HOLDS[new][0] - (HOLDS[old] if old is not None else _NONE)[0],
        HOLDS[new][1] - (HOLDS[old] if old is not None else _NONE)[1],
        HOLDS[new][2] - (HOLDS[old] if old is not None else _NONE)[2],
        stats,
    )
    for (old, event), (new, stats) in TRANSITIONS.items()
}

# The hot path's rows (Engine.save and the release drain apply them inline).
KEEP_ROW = ROWS[(None, Event.KEEP)]
DROP_KEPT_ROW = ROWS[(State.KEPT, Event.DROP)]
assert KEEP_ROW == (State.KEPT, 1, 0, 0, (("kept_bytes", True),)), KEEP_ROW
assert DROP_KEPT_ROW == (State.DROPPED, -1, 0, 0, ()), DROP_KEPT_ROW
