"""Pipeline hints from Megatron-core's schedules.

:func:`patch` replaces five module-level functions of
``megatron.core.pipeline_parallel.schedules``:

- ``forward_step`` / ``backward_step``: every schedule calls them by their module-level
  name for each microbatch. ``forward_step`` carries the model chunk and
  ``current_microbatch``; ``backward_step`` carries no microbatch id, so it is matched to its
  forward through the output object ``forward_step`` returned (the schedules pass that very
  object back to ``backward_step``).
- ``forward_backward_no_pipelining``, ``forward_backward_pipelining_without_interleaving``
  and ``forward_backward_pipelining_with_interleaving``: wrapped to compute this rank's order
  of forwards and backwards for the look-ahead (mirroring the schedule, with Megatron's own
  ``get_pp_rank_microbatches`` and ``get_schedule_table`` for the interleaved one).
  ``get_forward_backward_func()`` returns the wrapped functions; a reference taken before
  :func:`patch` still gets per-microbatch hints, without look-ahead.

Stage numbering: chunk ``c`` of pipeline rank ``r`` is stage ``c * pp_size + r`` (the global
virtual stage), ``r`` without interleaving, ``0`` without pipelining. The cache of a chunk is
the one registered for that chunk's module (or a module inside it, see
:mod:`tba.integrations.registry`).

Not hinted: ``overlap_moe_expert_parallel_comm`` (combined 1F1B runs its own
``combined_forward_backward_step``) and ``hybrid_context_parallel`` (no look-ahead) schedules.

Example:
    >>> import tba, tba.integrations.megatron as tm
    >>> tm.patch()
    >>> caches = [tba.configure_tensor_cache(chunk, offloader="ssd") for chunk in model]
    >>> get_forward_backward_func()(forward_step_func=..., model=model, ...)
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from tba.integrations import registry
from tba.integrations._engine import Engine, wrapper
from tba.integrations._hints import Plan, Step
from tba.integrations._patching import VersionRange
from tba.integrations.registry import CacheLike

__all__ = ["patch", "unpatch", "is_patched", "TESTED_VERSIONS"]

logger = logging.getLogger(__name__)

_signatures: dict[str, inspect.Signature] = {}

_SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _check(version: str) -> ModuleType:
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")

    def need(name: str, params: list[str], prefix: list[str] | None = None) -> None:
        func = ENGINE.require_attr(schedules, name, version)
        ENGINE.require_params(func, params, version, positional_prefix=prefix)

    need(
        "forward_step",
        [
            "forward_step_func",
            "data_iterator",
            "model",
            "num_microbatches",
            "input_tensor",
            "current_microbatch",
        ],
        ["forward_step_func", "data_iterator", "model"],
    )
    need("backward_step", ["input_tensor", "output_tensor"], ["input_tensor", "output_tensor"])
    for name in _SCHEDULE_FUNCTIONS:
        need(
            name,
            [
                "forward_step_func",
                "data_iterator",
                "model",
                "num_microbatches",
                "forward_only",
                "p2p_communicator",
            ],
        )
    need(
        "get_pp_rank_microbatches",
        [
            "num_microbatches",
            "num_model_chunks",
            "microbatch_group_size_per_vp_stage",
            "forward_only",
            "overlap_moe_expert_parallel_comm",
            "p2p_communicator",
        ],
    )
    need(
        "get_schedule_table",
        ["num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage"],
    )
    return schedules


def _install(schedules: ModuleType) -> None:
    _signatures["forward_step"] = inspect.signature(schedules.forward_step)
    _signatures["backward_step"] = inspect.signature(schedules.backward_step)
    patches = ENGINE.patches
    patches.replace_attr(schedules, "forward_step", _wrap_forward_step(schedules.forward_step))
    patches.replace_attr(schedules, "backward_step", _wrap_backward_step(schedules.backward_step))
    for name in _SCHEDULE_FUNCTIONS:
        wrapped = ENGINE.record_runs(getattr(schedules, name), _run_maker(name))
        patches.replace_attr(schedules, name, wrapped)


#: megatron-core versions this integration was run against (CPU, gloo, with a cuda shim).
TESTED_VERSIONS = VersionRange("0.16.1", "0.17")
ENGINE: Engine[ModuleType, _Run] = Engine(
    "megatron",
    TESTED_VERSIONS,
    module="megatron.core",
    distribution="megatron-core",
    check=_check,
    install=_install,
)


def is_patched() -> bool:
    return ENGINE.is_patched()


def patch() -> None:
    """Install the hint wrappers. Idempotent; undone by :func:`unpatch`.

    Raises:
        IntegrationVersionError: megatron-core's schedules differ from the checked ones.
        ImportError: megatron-core is not installed (``pip install 'tba[integrations]'``).
    """
    ENGINE.patch()


def unpatch() -> None:
    """Restore the original functions. Idempotent."""
    ENGINE.unpatch()


# ---------------------------------------------------------------------------------------------
# One call of a forward_backward_* function


class _Run:
    # Megatron ships no types: the values of ``kwargs`` (its call's arguments) are ``Any``.
    def __init__(self, kind: str, kwargs: dict[str, Any]) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules

        model = kwargs["model"]
        self.models: list[nn.Module] = list(model) if isinstance(model, list) else [model]
        self.forward_only = bool(kwargs.get("forward_only", False))
        num_microbatches = int(kwargs["num_microbatches"])
        p2p = kwargs.get("p2p_communicator")
        if kind == "forward_backward_no_pipelining":
            self.pp_size, self.pp_rank = 1, 0
        elif p2p is not None:
            self.pp_size, self.pp_rank = p2p.pp_group.size(), p2p.pp_group.rank()
        else:
            self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        config = _config_of(self.models[0])
        steps: list[Step] = []
        if getattr(config, "overlap_moe_expert_parallel_comm", False) and not self.forward_only:
            logger.debug("tba.integrations.megatron: combined 1F1B schedule, no look-ahead")
        elif kind == "forward_backward_no_pipelining":
            if not getattr(config, "hybrid_context_parallel", False):
                for i in range(num_microbatches):
                    steps.append(Step(0, i, "forward"))
                    if not self.forward_only:
                        steps.append(Step(0, i, "backward"))
        elif kind == "forward_backward_pipelining_without_interleaving":
            steps = self._one_f_one_b(num_microbatches)
        else:
            steps = self._interleaved(schedules, config, num_microbatches, p2p)
        # output object id -> (output object, its forward's step); see backward_step.
        self.pending: dict[int, tuple[object, Step]] = {}
        self.num_forwards = [0] * len(self.models)
        self.plan = Plan(steps, self._cache_of_stage)

    def stage_of_chunk(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def _cache_of_stage(self, stage: int) -> CacheLike | None:
        chunk, rank = divmod(stage, self.pp_size)
        if rank != self.pp_rank or not 0 <= chunk < len(self.models):
            return None
        return registry.lookup(self.models[chunk])

    def chunk_of(self, model: object) -> int | None:
        for index, candidate in enumerate(self.models):
            if candidate is model:
                return index
        return None

    def _one_f_one_b(self, n: int) -> list[Step]:
        stage = self.pp_rank
        warmup = min(self.pp_size - self.pp_rank - 1, n)
        steps = [Step(stage, i, "forward") for i in range(warmup)]
        for i in range(n - warmup):
            steps.append(Step(stage, warmup + i, "forward"))
            if not self.forward_only:
                steps.append(Step(stage, i, "backward"))
        if not self.forward_only:
            steps.extend(Step(stage, i, "backward") for i in range(n - warmup, n))
        return steps

    def _interleaved(self, schedules: ModuleType, config: Any, n: int, p2p: object) -> list[Step]:
        chunks = len(self.models)
        group = config.microbatch_group_size_per_vp_stage
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            n,
            chunks,
            group,
            forward_only=self.forward_only,
            overlap_moe_expert_parallel_comm=False,
            p2p_communicator=p2p,
        )
        table = schedules.get_schedule_table(n, chunks, group)
        backward_count = [0] * chunks

        def forward(k: int) -> Step:
            microbatch, chunk = table[k]
            return Step(self.stage_of_chunk(chunk), microbatch, "forward")

        def backward(k: int) -> Step:
            chunk = chunks - 1 - table[k % total][1]
            # Backward pops each chunk's forwards in order (FIFO), and a chunk's forwards run
            # microbatches in increasing order.
            microbatch = backward_count[chunk]
            backward_count[chunk] += 1
            return Step(self.stage_of_chunk(chunk), microbatch, "backward")

        steps = [forward(k) for k in range(warmup)]
        for k in range(remaining):
            steps.append(forward(k + warmup))
            if not self.forward_only:
                steps.append(backward(k))
        if not self.forward_only:
            steps.extend(backward(k) for k in range(remaining, total))
        return steps


def _config_of(model: object) -> Any:
    """The Megatron ``TransformerConfig`` of a model chunk (through its wrappers), or None."""
    while getattr(model, "config", None) is None and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


def _run_maker(kind: str) -> Callable[..., _Run]:
    def make_run(*args: object, **kwargs: Any) -> _Run:
        return _Run(kind, kwargs)

    return make_run


def _wrap_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = _signatures["forward_step"]

    @wrapper(original)
    def forward_step(*args: object, **kwargs: object) -> Any:
        run = ENGINE.current_run()
        if run is None:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        chunk = run.chunk_of(bound["model"])
        step = None
        if chunk is not None:
            microbatch = bound.get("current_microbatch")
            if microbatch is None:
                microbatch = run.num_forwards[chunk]
            run.num_forwards[chunk] += 1
            step = Step(run.stage_of_chunk(chunk), int(microbatch), "forward")
            run.plan.announce(step)
        result = original(*args, **kwargs)  # Megatron's (output_tensor, num_tokens)
        if step is not None and not run.forward_only:
            output = result[0]
            run.pending[id(output)] = (output, step)
        return result

    return forward_step


def _wrap_backward_step(original: Callable[..., object]) -> Callable[..., object]:
    signature = _signatures["backward_step"]

    @wrapper(original)
    def backward_step(*args: object, **kwargs: object) -> object:
        run = ENGINE.current_run()
        if run is not None:
            output = signature.bind_partial(*args, **kwargs).arguments.get("output_tensor")
            entry = run.pending.pop(id(output), None)
            if entry is not None and entry[0] is output:
                forward = entry[1]
                run.plan.announce(Step(forward.stage, forward.microbatch, "backward"))
            else:
                logger.debug("tba.integrations.megatron: backward_step for an unknown output")
        return original(*args, **kwargs)

    return backward_step
