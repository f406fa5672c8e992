"""A stand-in for ``tba.TensorCache`` that only records the hints it is given."""

from __future__ import annotations

from typing import Any


class RecordingCache:
    """Records every ``set_stage`` call; ``stage_log`` mirrors the real cache's."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        #: if set, each call also appends ("hint", stage, microbatch, action) here, so a test
        #: can interleave hints with what the engine was doing.
        self.trace: list[Any] | None = None

    def set_stage(
        self,
        *,
        microbatch: int | None,
        action: str,
        stage: int = 0,
        next_microbatch: int | None = None,
        next_action: str | None = None,
        next_stage: int | None = None,
    ) -> None:
        if self.trace is not None:
            self.trace.append(("hint", stage, microbatch, action))
        self.calls.append(
            dict(
                stage=stage,
                microbatch=microbatch,
                action=action,
                next_stage=next_stage,
                next_microbatch=next_microbatch,
                next_action=next_action,
            )
        )

    @property
    def stage_log(self) -> list[tuple[int, int | None, str]]:
        return [(c["stage"], c["microbatch"], c["action"]) for c in self.calls]

    def lookahead_log(self) -> list[tuple[int | None, int | None, str | None]]:
        return [(c["next_stage"], c["next_microbatch"], c["next_action"]) for c in self.calls]

    def close(self) -> None:
        from tba.integrations import registry

        registry.unregister(self)


def expected_lookahead(log: list[tuple[int, int | None, str]]) -> list[tuple[Any, Any, Any]]:
    """For a cache's own step sequence, the look-ahead each step should carry: the next one."""
    return [tuple(log[i + 1]) if i + 1 < len(log) else (None, None, None) for i in range(len(log))]
