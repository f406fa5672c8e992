"""What the engine's counters must equal, and the step's counters handed out
(``EngineAccounting``: a mixin of ``Engine``).

Note [Cache invariants]: after a completed step the byte counters (resident, in flight, held
by the offloader) equal the sum of ``HOLDS`` over the live entries and those dropped while a
worker still copies them (Note [Entry state machine]); an entry has an offloader token exactly
when its state holds offloader space; every live entry has a handle; with
``TBA_CHECK_INVARIANTS=1`` the cache checks this after every step and raises a ``TBAError``
naming the broken invariant in the training step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tba.cache.engine.entries import Entry
from tba.cache.engine.states import HOLDS, State
from tba.cache.observe.stats import CacheStats

if TYPE_CHECKING:
    import threading

    from tba.cache.engine.table import EntryTable

__all__ = ["EngineAccounting"]

S = State


class EngineAccounting:
    """Step counters and invariants of ``Engine``."""

    lock: threading.RLock
    table: EntryTable
    orphans: set[Entry]
    step: CacheStats
    resident_bytes: int
    inflight_bytes: int
    held_bytes: int
    raised_this_step: bool

    def take_step(self) -> CacheStats:
        """The counters since the last call (one step), and start new ones (lock held)."""
        step, fresh = self.step, CacheStats()
        fresh.peak_resident_bytes = self.resident_bytes
        self.step, self.raised_this_step = fresh, False
        step.num_packed, step.num_deduplicated, step.num_family_entries = self.table.take_counts()
        step.num_steps = 1
        step.finish_rates()
        return step

    def check(self) -> list[str]:
        """Note [Cache invariants]: the counters equal what the live entries and the orphans
        hold by their states (``HOLDS``), an entry holds an offloader token exactly when its state
        holds offloader space, as readable problems (empty when all hold)."""
        with self.lock:
            entries = self.table.entries()
            problems = []
            sums = [0, 0, 0]
            for entry in entries + list(self.orphans):
                for i, k in enumerate(HOLDS[entry.state] if entry.state is not None else (0, 0, 0)):
                    sums[i] += k * entry.nbytes
            for name, counter, expected in zip(
                ("resident_bytes", "inflight_bytes", "held_bytes"),
                (self.resident_bytes, self.inflight_bytes, self.held_bytes),
                sums,
            ):
                if counter != expected:
                    problems.append(
                        f"{name} is {counter} but the {len(entries)} live entries and "
                        f"{len(self.orphans)} dropped ones still copying account for {expected}"
                    )
            for entry in entries + list(self.orphans):
                # Offloader space (a token) exactly where the state says so: Note [A reloaded
                # entry holds no offloader space] in workers.py.
                holds_space = entry.state is not None and HOLDS[entry.state][2] > 0
                has_token = entry.xfer is not None and entry.xfer.token is not None
                if holds_space != has_token:
                    problems.append(
                        f"a {entry.state} entry of {entry.nbytes} bytes "
                        f"{'has' if has_token else 'has no'} offloader token"
                    )
                    break
            for entry in entries:
                if not entry.num_handles and entry.state is not S.DROPPED:
                    problems.append(f"a {entry.state} entry of {entry.nbytes} bytes has no handle left")
                    break
            return problems

    def holds_offloaded_data(self) -> bool:
        """Whether any entry (live, or dropped while a worker copies it) holds offloader space
        or a store in progress: the offloader's own count of used bytes is then not zero."""
        with self.lock:
            return bool(self.orphans) or any(
                e.xfer is not None and (e.xfer.token is not None or e.state in (S.STORING, S.STORING_WANTED))
                for e in self.table.entries()
            )
