"""Pipeline hints from ``torch.distributed.pipelining``.

:func:`patch` wraps three methods of ``_PipelineStageBase`` (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``: they carry the stage and the
microbatch) and ``step`` of ``PipelineScheduleSingle`` / ``PipelineScheduleMulti`` (to read the
schedule's own per-rank order, ``pipeline_order_with_comms`` or ``pipeline_order``, for the
look-ahead). Before each compute action, the cache registered for the stage's ``submod`` (see
:mod:`tba.integrations.registry`) gets ``set_stage(stage=stage_index, microbatch=..., action=
"forward" | "backward" | "input_grad" | "weight_grad", next_...=<its next action>)``.

Checked with ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV.

Example:
    >>> import tba, tba.integrations.torch_pipelining as tp
    >>> tp.patch()
    >>> cache = tba.configure_tensor_cache(stage.submod, offloader="host")
    >>> schedule = ScheduleInterleaved1F1B([stage0, stage2], n_microbatches=8, loss_fn=loss)
    >>> schedule.step(x, target=y)  # the cache now sees every (stage, microbatch, action)
    >>> tp.unpatch()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from tba.cache.steps.stages import Action
from tba.integrations import registry
from tba.integrations._engine import Engine, wrapper
from tba.integrations._hints import Plan, Step, announce
from tba.integrations._patching import VersionRange
from tba.integrations.registry import CacheLike

if TYPE_CHECKING:  # imported when patching, not with this module
    from typing import TypeAlias

    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        _Action,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    Schedule: TypeAlias = PipelineScheduleSingle | PipelineScheduleMulti
    _Targets: TypeAlias = tuple[
        type[_PipelineStageBase], type[PipelineScheduleSingle], type[PipelineScheduleMulti]
    ]

__all__ = [
    "patch",
    "unpatch",
    "is_patched",
    "TESTED_VERSIONS",
    "plan_for",
    "ACTION_OF_COMPUTATION_TYPE",
]

logger = logging.getLogger(__name__)

#: The action each of torch's ``_ComputationType`` letters stands for (compute actions only).
ACTION_OF_COMPUTATION_TYPE: dict[str, Action] = {
    "F": "forward",
    "B": "backward",
    "I": "input_grad",
    "W": "weight_grad",
}


def _check(version: str) -> _Targets:
    from torch.distributed.pipelining import schedules, stage

    need, params = ENGINE.require_attr, ENGINE.require_params
    base = need(stage, "_PipelineStageBase", version)
    params(
        need(base, "forward_one_chunk", version),
        ["fwd_chunk_id", "args", "kwargs"],
        version,
        positional_prefix=["self", "fwd_chunk_id"],
    )
    params(
        need(base, "backward_one_chunk", version),
        ["bwd_chunk_id", "loss", "full_backward", "last_backward"],
        version,
        positional_prefix=["self", "bwd_chunk_id", "loss", "full_backward"],
    )
    params(
        need(base, "backward_weight_one_chunk", version),
        ["bwd_chunk_id"],
        version,
        positional_prefix=["self", "bwd_chunk_id"],
    )
    for cls_name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        need(need(schedules, cls_name, version), "step", version)
    need(schedules, "_Action", version)
    need(schedules, "_ComputationType", version)
    for member in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B"):
        need(schedules._ComputationType, member, version)
    return base, schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti


def _install(targets: _Targets) -> None:
    base, single, multi = targets
    patches = ENGINE.patches
    patches.replace_attr(base, "forward_one_chunk", _wrap_forward(base.forward_one_chunk))
    patches.replace_attr(base, "backward_one_chunk", _wrap_backward(base.backward_one_chunk))
    patches.replace_attr(
        base, "backward_weight_one_chunk", _wrap_weight(base.backward_weight_one_chunk)
    )
    for cls in (single, multi):
        patches.replace_attr(cls, "step", ENGINE.record_runs(cls.step, _Run.of_schedule))


#: torch versions this integration was run against (CPU, gloo).
TESTED_VERSIONS = VersionRange("2.13", "2.14")
ENGINE: Engine[_Targets, _Run] = Engine(
    "torch_pipelining",
    TESTED_VERSIONS,
    module="torch.distributed.pipelining",
    distribution="torch",
    check=_check,
    install=_install,
)


def is_patched() -> bool:
    return ENGINE.is_patched()


def patch() -> None:
    """Install the hint wrappers. Idempotent; undone by :func:`unpatch`.

    Raises:
        IntegrationVersionError: torch's pipelining internals differ from the checked ones.
    """
    ENGINE.patch()


def unpatch() -> None:
    """Restore the original methods. Idempotent."""
    ENGINE.unpatch()


# ---------------------------------------------------------------------------------------------
# The schedule's plan for this rank


def _schedule_stages(schedule: Schedule) -> list[_PipelineStageBase]:
    from torch.distributed.pipelining import schedules

    if isinstance(schedule, schedules.PipelineScheduleMulti):
        return list(schedule._stages)
    return [schedule._stage]


def _single_stage_plan(schedule: PipelineScheduleSingle) -> list[Step] | None:
    """GPipe and 1F1B run their own loops; their ``pipeline_order`` is only a picture and is
    wrong for 1F1B's last stage in torch 2.13 (it lists F1..F4 where F0..F3 run). Mirror the
    loops of ``_step_microbatches`` instead."""
    from torch.distributed.pipelining import schedules

    cls = type(schedule)
    stage = schedule._stage
    n = schedule._n_microbatches
    index = int(stage.stage_index)
    backward = getattr(schedule, "_has_backward", True)
    if cls._step_microbatches is schedules.ScheduleGPipe._step_microbatches:
        steps = [Step(index, i, "forward") for i in range(n)]
        return steps + ([Step(index, i, "backward") for i in range(n)] if backward else [])
    if cls._step_microbatches is schedules.Schedule1F1B._step_microbatches:
        if not backward:  # eval(): backward_one_chunk returns at once
            return [Step(index, i, "forward") for i in range(n)]
        warmup = min(n, schedule._num_stages - index)
        steps = [Step(index, i, "forward") for i in range(warmup)]
        fwd, bwd = warmup, 0
        while True:
            steps.append(Step(index, bwd, "backward"))
            bwd += 1
            if fwd == n:
                break
            steps.append(Step(index, fwd, "forward"))
            fwd += 1
        steps.extend(Step(index, i, "backward") for i in range(bwd, n))
        return steps
    return None


def plan_for(schedule: Schedule) -> list[Step]:
    """This rank's compute steps, in the order ``schedule.step()`` runs them.

    Single-stage GPipe/1F1B: their loops, mirrored. Otherwise read from
    ``pipeline_order_with_comms`` (what ``_PipelineScheduleRuntime`` executes) or
    ``pipeline_order``; empty when the schedule has neither (no look-ahead then).
    """
    from torch.distributed.pipelining import schedules

    if isinstance(schedule, schedules.PipelineScheduleSingle):
        mirrored = _single_stage_plan(schedule)
        if mirrored is not None:
            return mirrored
    stages = _schedule_stages(schedule)
    rank = getattr(schedule, "rank", None)
    if rank is None:  # single-stage schedules key their order by stage index
        rank = stages[0].stage_index
    order = getattr(schedule, "pipeline_order_with_comms", None) or getattr(
        schedule, "pipeline_order", None
    )
    if not order or rank not in order:
        return []
    has_backward = getattr(schedule, "_has_backward", True)
    steps: list[Step] = []

    def add(action: _Action | None) -> None:
        if action is None:
            return
        if action.sub_actions:
            for sub in action.sub_actions:
                add(sub)
            return
        kind = ACTION_OF_COMPUTATION_TYPE.get(action.computation_type.value)
        if kind is None or action.microbatch_index is None:
            return  # communication, unshard, reduce-grad
        if kind != "forward" and not has_backward:
            return
        steps.append(Step(int(action.stage_index), int(action.microbatch_index), kind))

    for action in order[rank]:
        add(action)
    return steps


class _Run(NamedTuple):
    """One ``schedule.step()`` in progress: the stages it runs on this rank and their plan."""

    stages: list[_PipelineStageBase]
    plan: Plan

    @classmethod
    def of_schedule(cls, schedule: Schedule, *args: object, **kwargs: object) -> _Run:
        stages = _schedule_stages(schedule)
        by_index = {s.stage_index: s for s in stages}

        def cache_of_stage(stage_index: int) -> CacheLike | None:
            stage = by_index.get(stage_index)
            return None if stage is None else registry.lookup(stage.submod)

        return cls(stages, Plan(plan_for(schedule), cache_of_stage))


def _plan_of(stage: _PipelineStageBase) -> Plan | None:
    run = ENGINE.current_run(lambda r: any(s is stage for s in r.stages))
    return None if run is None else run.plan


def _announce(stage: _PipelineStageBase, microbatch: int, action: Action) -> None:
    if action != "forward" and not getattr(stage, "has_backward", True):
        return  # eval(): the stage returns without running backward
    cache = registry.lookup(stage.submod)
    if cache is None:
        return
    step = Step(int(stage.stage_index), int(microbatch), action)
    plan = _plan_of(stage)
    if plan is None:
        announce(cache, step, None)
    else:
        plan.announce(step, cache)


# ---------------------------------------------------------------------------------------------
# Wrappers


def _wrap_forward(original: Callable[..., object]) -> Callable[..., object]:
    @wrapper(original)
    def forward_one_chunk(
        self: _PipelineStageBase, fwd_chunk_id: int, *args: object, **kwargs: object
    ) -> object:
        _announce(self, fwd_chunk_id, "forward")
        return original(self, fwd_chunk_id, *args, **kwargs)

    return forward_one_chunk


def _wrap_backward(original: Callable[..., object]) -> Callable[..., object]:
    @wrapper(original)
    def backward_one_chunk(
        self: _PipelineStageBase, bwd_chunk_id: int, *args: object, **kwargs: object
    ) -> object:
        # (loss, full_backward, last_backward) follow bwd_chunk_id, checked in _check().
        full_backward = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        _announce(self, bwd_chunk_id, "backward" if full_backward else "input_grad")
        return original(self, bwd_chunk_id, *args, **kwargs)

    return backward_one_chunk


def _wrap_weight(original: Callable[..., object]) -> Callable[..., object]:
    @wrapper(original)
    def backward_weight_one_chunk(
        self: _PipelineStageBase, bwd_chunk_id: int, *args: object, **kwargs: object
    ) -> object:
        _announce(self, bwd_chunk_id, "weight_grad")
        return original(self, bwd_chunk_id, *args, **kwargs)

    return backward_weight_one_chunk
