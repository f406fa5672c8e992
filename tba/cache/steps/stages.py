"""`StageHint`: what a pipeline scheduler says runs now and next (``TensorCache.set_stage``).

This module is also the one home of the action names: ``tba.integrations`` imports them from
here (and this module imports nothing from tba).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

__all__ = ["StageHint", "Action", "ACTIONS", "BACKWARD_ACTIONS"]

#: What a pipeline step does to one (stage, microbatch): its forward, its whole backward, or the
#: two halves of a split backward (zero-bubble schedules).
Action = Literal["forward", "backward", "input_grad", "weight_grad"]
ACTIONS: tuple[Action, ...] = typing.get_args(Action)
BACKWARD_ACTIONS: tuple[Action, ...] = ACTIONS[1:]


@dataclasses.dataclass(frozen=True)
class StageHint:
    """One ``set_stage`` call: the action about to run and, if known, the one after it."""

    stage: int
    microbatch: int | None
    action: str
    next_stage: int | None = None
    next_microbatch: int | None = None
    next_action: str | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r}: expected one of {ACTIONS}"
            for name, value in (("action", self.action), ("next_action", self.next_action))
            if (value is not None or name == "action") and value not in ACTIONS
        ]
        if problems:
            raise ValueError("TensorCache.set_stage: " + "; ".join(problems))

    @property
    def record_key(self) -> tuple[int, int]:
        """The (stage, microbatch) record a forward with this hint fills."""
        return (self.stage, self.microbatch if self.microbatch is not None else -1)

    @property
    def keeps_tail(self) -> bool:
        """Whether this forward's last blocks stay in memory: only when its own backward runs
        next (or nothing is known about what follows)."""
        return self.next_action is None or (
            self.next_action in BACKWARD_ACTIONS and self.next_microbatch == self.microbatch
        )

    @property
    def prefetch_keys(self) -> list[tuple[int, int]]:
        """Records whose backward runs now or next: their tensors should start loading."""
        keys = []
        if self.action in BACKWARD_ACTIONS:
            keys.append(self.record_key)
        if self.next_action in BACKWARD_ACTIONS and self.next_microbatch is not None:
            stage = self.next_stage if self.next_stage is not None else self.stage
            keys.append((stage, self.next_microbatch))
        return keys
