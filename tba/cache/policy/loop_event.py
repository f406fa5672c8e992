"""`LoopEvent`: one decision of the closed loop (Note [Closed loop]), for logs and timelines
(``tba.testing.probe(cache).loop_events``)."""

from __future__ import annotations

import dataclasses

__all__ = ["LoopEvent"]


@dataclasses.dataclass(frozen=True)
class LoopEvent:
    """A decision of the loop, for logs and timelines.

    Attributes:
        step: the step whose time led to it (None when the feeder gave no step numbers).
        kind: ``"measure"`` (start measuring ``tail_start``), ``"pass"`` / ``"fail"`` (its
            verdict), ``"settle"`` (the check ends at ``tail_start``), ``"suspect"`` (steady
            steps look over budget: check again), ``"recheck"`` (a new profile is due).
        tail_start: the boundary concerned.
        text: one line saying why.
    """

    step: int | None
    kind: str
    tail_start: int
    text: str
