"""Pipeline hints from DeepSpeed's ``PipelineEngine``.

``PipelineEngine._exec_schedule`` walks a ``PipeSchedule`` (a generator of instruction lists,
one list per pipeline step) and dispatches each instruction through the class dict
``PipelineEngine._INSTRUCTION_MAP``. :func:`patch` wraps ``_exec_schedule`` (to expand the
schedule, which is a pure function of (micro_batches, stages, stage_id), into this rank's
instruction list) and every entry of ``_INSTRUCTION_MAP`` (to follow execution).

Each ``ForwardPass`` / ``BackwardPass`` is announced to the cache of ``engine.module`` at the
*first instruction after the previous compute instruction*: the communication
(``RecvGrad``, ``SendActivation``, ``SendGrad``, ``RecvActivation``) and ``LoadMicroBatch``
instructions that precede it. So while a backward's gradients arrive from the next stage, its
activations are already being read back. The microbatch comes from the schedule
(``TrainSchedule._step_to_micro_batch``; ``InferenceSchedule``: ``step - stage_id``); the stage
is ``engine.stage_id``.

Schedules other than ``TrainSchedule``, ``InferenceSchedule`` and ``DataParallelSchedule``
(or an execution that departs from the expanded list) fall back to announcing at the compute
instruction itself, with the microbatch tracked through the instruction's ``buffer_id`` and
no look-ahead. ``DualPipeVEngine`` (its own instruction map) is not hinted.

Example:
    >>> import tba, tba.integrations.deepspeed as tds
    >>> tds.patch()
    >>> engine, *_ = deepspeed.initialize(model=pipeline_module, config=ds_config, ...)
    >>> cache = tba.configure_tensor_cache(engine.module, offloader="ssd")
    >>> engine.train_batch(data_iter)
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tba.cache.steps.stages import Action
from tba.integrations import registry
from tba.integrations._engine import Engine, wrapper
from tba.integrations._hints import Plan, Step, announce
from tba.integrations._patching import VersionRange

__all__ = ["patch", "unpatch", "is_patched", "TESTED_VERSIONS"]

logger = logging.getLogger(__name__)

_INSTRUCTIONS = (
    "ForwardPass",
    "BackwardPass",
    "LoadMicroBatch",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "OptimizerStep",
)


# DeepSpeed ships no types: its classes and objects (the PipelineEngine class, an engine, a
# PipeSchedule) are ``Any`` here.
_Targets = tuple[Any, ModuleType]  # (PipelineEngine, deepspeed.runtime.pipe.schedule)


def _check(version: str) -> _Targets:
    engine = importlib.import_module("deepspeed.runtime.pipe.engine")
    schedule = importlib.import_module("deepspeed.runtime.pipe.schedule")

    need, params = ENGINE.require_attr, ENGINE.require_params
    pipeline_engine = need(engine, "PipelineEngine", version)
    instruction_map = need(pipeline_engine, "_INSTRUCTION_MAP", version)
    params(
        need(pipeline_engine, "_exec_schedule", version),
        ["pipe_schedule"],
        version,
        positional_prefix=["self", "pipe_schedule"],
    )
    for name in _INSTRUCTIONS:
        cls = need(schedule, name, version)
        if not isinstance(instruction_map, dict) or cls not in instruction_map:
            raise ENGINE.mismatch(version, f"PipelineEngine._INSTRUCTION_MAP has no {name}")
    for name in ("ForwardPass", "BackwardPass"):
        params(instruction_map[getattr(schedule, name)], ["buffer_id"], version)
    train = need(schedule, "TrainSchedule", version)
    params(need(train, "_step_to_micro_batch", version), ["step_id"], version)
    for name in ("InferenceSchedule", "DataParallelSchedule", "PipeSchedule"):
        need(schedule, name, version)
    return pipeline_engine, schedule


def _install(targets: _Targets) -> None:
    pipeline_engine, schedule = targets
    try:  # Engines that copy the map at import (DualPipeV) must copy the originals.
        import deepspeed.runtime.pipe.dualpipev  # noqa: F401
    except ImportError:
        pass
    instruction_map = pipeline_engine._INSTRUCTION_MAP
    for cls in list(instruction_map):
        ENGINE.patches.replace_item(
            instruction_map, cls, _wrap_instruction(cls, instruction_map[cls], schedule)
        )

    def make_run(engine: Any, pipe_schedule: Any, *args: object, **kwargs: object) -> _Run | None:
        if type(engine)._INSTRUCTION_MAP is not pipeline_engine._INSTRUCTION_MAP:
            return None  # its own instruction map (DualPipeVEngine): not hinted
        return _Run(engine, pipe_schedule)

    ENGINE.patches.replace_attr(
        pipeline_engine,
        "_exec_schedule",
        ENGINE.record_runs(pipeline_engine._exec_schedule, make_run),
    )


#: DeepSpeed versions this integration was run against (CPU accelerator, gloo).
TESTED_VERSIONS = VersionRange("0.19.8", "0.20")
ENGINE: Engine[_Targets, _Run] = Engine(
    "deepspeed",
    TESTED_VERSIONS,
    module="deepspeed",
    distribution="deepspeed",
    check=_check,
    install=_install,
)


def is_patched() -> bool:
    return ENGINE.is_patched()


def patch() -> None:
    """Install the hint wrappers. Idempotent; undone by :func:`unpatch`.

    Raises:
        IntegrationVersionError: DeepSpeed's pipeline engine differs from the checked one.
        ImportError: DeepSpeed is not installed (``pip install 'tba[integrations]'``).
    """
    ENGINE.patch()


def unpatch() -> None:
    """Restore ``_exec_schedule`` and the instruction map. Idempotent."""
    ENGINE.unpatch()


# ---------------------------------------------------------------------------------------------
# One _exec_schedule call


class _Run:
    def __init__(self, engine: Any, pipe_schedule: Any) -> None:
        schedule = importlib.import_module("deepspeed.runtime.pipe.schedule")

        self.engine = engine
        self.stage = int(engine.stage_id)
        self.cache = registry.lookup(engine.module)
        # Expected instruction stream: (instruction type, buffer_id) per instruction.
        self.expected: list[tuple[type, object]] = []
        # Instruction index -> the compute step announced when execution reaches it.
        self.announce_at: dict[int, Step] = {}
        # Instruction index of each ForwardPass/BackwardPass -> its step.
        self.compute_at: dict[int, Step] = {}
        self.cursor = 0
        self.lost = True
        # Fallback bookkeeping: buffer -> microbatch last forwarded into it.
        self.buffer_microbatch: dict[object, int] = {}
        self.num_forwards = 0
        steps: list[Step] = []
        microbatch_of = _microbatch_function(schedule, pipe_schedule)
        if microbatch_of is not None:
            announce_from = 0
            for step_id, cmds in enumerate(pipe_schedule.steps()):
                for cmd in cmds:
                    index = len(self.expected)
                    self.expected.append((type(cmd), cmd.kwargs.get("buffer_id")))
                    if type(cmd) in (schedule.ForwardPass, schedule.BackwardPass):
                        action: Action = "forward" if type(cmd) is schedule.ForwardPass else "backward"
                        step = Step(self.stage, int(microbatch_of(step_id)), action)
                        steps.append(step)
                        self.compute_at[index] = step
                        self.announce_at[announce_from] = step
                        announce_from = index + 1
            self.lost = False
        self.plan = Plan(steps, lambda stage: self.cache if stage == self.stage else None)

    def before(self, cls: type, kwargs: dict[str, object], schedule: ModuleType) -> None:
        if not self.lost:
            index = self.cursor
            expected = self.expected[index] if index < len(self.expected) else None
            if expected == (cls, kwargs.get("buffer_id")):
                self.cursor += 1
                step = self.announce_at.get(index)
                if step is not None:
                    self.plan.announce(step, self.cache)
                compute = self.compute_at.get(index)
                if compute is not None and compute.action == "forward":
                    self.buffer_microbatch[kwargs.get("buffer_id")] = compute.microbatch
                    self.num_forwards += 1
                return
            logger.warning(
                "tba.integrations.deepspeed: instruction %s(%s) at position %d departs from the "
                "schedule (expected %s); hints continue without look-ahead",
                cls.__name__,
                kwargs,
                index,
                expected,
            )
            self.lost = True
        self._fallback(cls, kwargs, schedule)

    def _fallback(self, cls: type, kwargs: dict[str, object], schedule: ModuleType) -> None:
        buffer_id = kwargs.get("buffer_id")
        action: Action
        if cls is schedule.ForwardPass:
            microbatch = self.num_forwards
            self.num_forwards += 1
            self.buffer_microbatch[buffer_id] = microbatch
            action = "forward"
        elif cls is schedule.BackwardPass and buffer_id in self.buffer_microbatch:
            microbatch = self.buffer_microbatch[buffer_id]
            action = "backward"
        else:
            return
        if self.cache is not None:
            announce(self.cache, Step(self.stage, microbatch, action), None)


def _microbatch_function(schedule: ModuleType, pipe_schedule: Any) -> Callable[[int], int] | None:
    kind = type(pipe_schedule)
    if kind is schedule.TrainSchedule:
        return lambda step_id: pipe_schedule._step_to_micro_batch(step_id)[0]
    if kind is schedule.InferenceSchedule:
        return lambda step_id: step_id - pipe_schedule.stage_id
    if kind is schedule.DataParallelSchedule:
        return lambda step_id: step_id
    logger.debug("tba.integrations.deepspeed: %s is not expanded; no look-ahead", kind.__name__)
    return None


def _wrap_instruction(
    cls: type, original: Callable[..., object], schedule: ModuleType
) -> Callable[..., object]:
    @wrapper(original)
    def instruction(self: object, **kwargs: object) -> object:
        run = ENGINE.current_run(lambda r: r.engine is self)
        if run is not None:
            run.before(cls, kwargs, schedule)
        return original(self, **kwargs)

    return instruction
