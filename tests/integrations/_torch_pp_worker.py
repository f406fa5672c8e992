"""Worker side of the torch.distributed.pipelining tests (runs in each spawned rank).

Every schedule is run three ways on the same weights and data: without tba, with a recording
stand-in cache (the hints), and with the real cache for each offloader (bit-exactness,
``num_sync_loads``). All cases share one process group.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.integrations import _common
from tests.integrations._fakes import RecordingCache

D = 16
BATCH = 8
NUM_MICROBATCHES = 4
NUM_STEPS = 2

# name -> (stage placement, class name in torch.distributed.pipelining)
SCHEDULES: dict[str, tuple[str, str]] = {
    "GPipe": ("single", "ScheduleGPipe"),
    "1F1B": ("single", "Schedule1F1B"),
    "Interleaved1F1B": ("loop", "ScheduleInterleaved1F1B"),
    "LoopedBFS": ("loop", "ScheduleLoopedBFS"),
    "InterleavedZeroBubble": ("loop", "ScheduleInterleavedZeroBubble"),
    "ZBVZeroBubble": ("v", "ScheduleZBVZeroBubble"),
    "DualPipeV": ("v", "ScheduleDualPipeV"),
}


def stage_indices(placement: str, rank: int, world: int) -> tuple[list[int], int]:
    if placement == "single":
        return [rank], world
    if placement == "loop":
        return [rank, rank + world], 2 * world
    return [rank, 2 * world - 1 - rank], 2 * world  # "v"


def stage_module(stage_index: int) -> nn.Module:
    gen = torch.Generator().manual_seed(1000 + stage_index)
    module = nn.Sequential(
        nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D), nn.Tanh(), _common.SettleStores()
    )
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def expected_order(schedule: Any, rank: int) -> list[tuple[int, int, str]]:
    """The schedule's own per-rank order, compute actions only (independent of tba's plan;
    only the action names are tba's)."""
    from tba.integrations.torch_pipelining import ACTION_OF_COMPUTATION_TYPE as names

    order = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    out: list[tuple[int, int, str]] = []

    def visit(action: Any) -> None:
        if action is None:
            return
        if action.sub_actions:
            for sub in action.sub_actions:
                visit(sub)
        elif action.computation_type.value in names:
            out.append(
                (action.stage_index, action.microbatch_index, names[action.computation_type.value])
            )

    key = rank if getattr(schedule, "rank", None) is not None else schedule._stage.stage_index
    for action in order[key]:
        visit(action)
    return out


@contextlib.contextmanager
def record_execution(log: list[tuple[int, int, str]]) -> Iterator[None]:
    """Record every compute call the stages really make, below tba's wrappers (install this
    before ``patch()``): the ground truth the hints are compared with."""
    from torch.distributed.pipelining.stage import _PipelineStageBase as base

    originals = {
        name: base.__dict__[name]
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    }

    @functools.wraps(originals["forward_one_chunk"])
    def forward(self, chunk, *args, **kwargs):
        log.append((self.stage_index, chunk, "forward"))
        return originals["forward_one_chunk"](self, chunk, *args, **kwargs)

    @functools.wraps(originals["backward_one_chunk"])
    def backward(self, chunk, loss=None, full_backward=True, last_backward=False):
        if self.has_backward:
            log.append((self.stage_index, chunk, "backward" if full_backward else "input_grad"))
        return originals["backward_one_chunk"](self, chunk, loss, full_backward, last_backward)

    @functools.wraps(originals["backward_weight_one_chunk"])
    def weight(self, chunk, *args, **kwargs):
        if self.has_backward:
            log.append((self.stage_index, chunk, "weight_grad"))
        return originals["backward_weight_one_chunk"](self, chunk, *args, **kwargs)

    base.forward_one_chunk = forward
    base.backward_one_chunk = backward
    base.backward_weight_one_chunk = weight
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(base, name, fn)


def build_schedule(name: str, rank: int, world: int, make_cache: Any) -> tuple:
    """This rank's stage indices, the stage count, stage modules, caches and the schedule."""
    from torch.distributed import pipelining

    placement, cls_name = SCHEDULES[name]
    local, num_stages = stage_indices(placement, rank, world)
    modules = {i: stage_module(i) for i in local}
    stages = [
        pipelining.PipelineStage(modules[i], i, num_stages, torch.device("cpu")) for i in local
    ]
    caches = {i: make_cache(modules[i]) for i in local}
    cls = getattr(pipelining, cls_name)
    loss_fn = lambda out, target: F.mse_loss(out, target)  # noqa: E731
    target_stages = stages[0] if placement == "single" else stages
    schedule = cls(target_stages, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
    return local, num_stages, modules, caches, schedule


def run_schedule(
    name: str, rank: int, world: int, make_cache: Any, patched: Any = contextlib.nullcontext
) -> dict[str, Any]:
    """Two training steps of schedule ``name``; returns losses, grads and per-cache logs."""
    local, num_stages, modules, caches, schedule = build_schedule(name, rank, world, make_cache)
    params = [p for i in local for p in modules[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(7)
    out = _common.new_results()
    out["schedule_order"] = expected_order(schedule, rank)
    try:
        for _ in range(NUM_STEPS):
            x = torch.randn(BATCH, D, generator=gen)
            target = torch.randn(BATCH, D, generator=gen)
            for c in caches.values():
                if isinstance(c, RecordingCache):
                    c.calls.clear()
            starts = {i: len(getattr(c, "stage_log", ())) for i, c in caches.items()}
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            args = (x,) if 0 in local else ()
            kwargs = {"target": target, "losses": losses} if num_stages - 1 in local else {}
            executed: list[tuple[int, int, str]] = []
            with record_execution(executed), patched():
                schedule.step(*args, **kwargs)
            out["executed"].append(executed)
            out["losses"].append([loss.detach().clone() for loss in losses])
            out["grads"].append(
                {
                    f"{i}.{n}": p.grad.clone()
                    for i in local
                    for n, p in modules[i].named_parameters()
                }
            )
            _common.record_caches(out, caches, starts)
            opt.step()
    finally:
        for c in caches.values():
            if c is not None:
                c.close()
    dist.barrier()
    return out


def run_eval(name: str, rank: int, world: int, make_cache: Any, patched: Any) -> dict:
    """``schedule.eval()`` (forward only) under the patch: only forwards are announced."""
    local, num_stages, _, caches, schedule = build_schedule(name, rank, world, make_cache)
    x, target = torch.randn(BATCH, D), torch.randn(BATCH, D)
    try:
        with patched():
            schedule.eval(
                *((x,) if 0 in local else ()),
                **({"target": target} if num_stages - 1 in local else {}),
            )
    finally:
        for c in caches.values():
            c.close()
    dist.barrier()
    return {i: c.stage_log for i, c in caches.items()}


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    from tba.integrations import torch_pipelining
    from tests.integrations._dist import run_cases

    recording = _common.recording_cache

    patched = functools.partial(_common.patched, torch_pipelining)

    cases: dict[str, Any] = {}
    baselines: dict[str, dict[str, Any]] = {}

    def baseline(name: str) -> Any:
        def case() -> Any:
            baselines[name] = run_schedule(name, rank, world, lambda m: None)
            return None

        return case

    def hints(name: str) -> Any:
        def case() -> Any:
            got = run_schedule(name, rank, world, recording, patched)
            _common.check_hints(got)
            # The schedule's own order is what ran, except on 1F1B's last stage, where torch
            # 2.13's Schedule1F1B.pipeline_order lists F1..F4 instead of F0..F3 (the integration
            # mirrors the 1F1B loop instead of reading it).
            if not (name == "1F1B" and rank == world - 1):
                for executed in got["executed"]:
                    assert [tuple(a) for a in executed] == [tuple(a) for a in got["schedule_order"]]
            _common.check_bit_exact(baselines[name], got)
            return None

        return case

    def offload(name: str, offloader: str) -> Any:
        def case() -> Any:
            with tempfile.TemporaryDirectory(prefix="tba-int-") as tmp, _common.settling():
                got = run_schedule(
                    name, rank, world, lambda m: _common.real_cache(m, offloader, tmp), patched
                )
            _common.check_bit_exact(baselines[name], got)
            _common.check_real_cache(got)
            return got["stats"]

        return case

    def evaluation(name: str) -> Any:
        def case() -> None:
            logs = run_eval(name, rank, world, recording, patched)
            for stage, log in logs.items():
                assert log == [(stage, i, "forward") for i in range(NUM_MICROBATCHES)], log

        return case

    for name in SCHEDULES:
        cases[f"{name}/baseline"] = baseline(name)
        cases[f"{name}/hints"] = hints(name)
        if SCHEDULES[name][0] != "v":  # torch 2.13's V schedules cannot eval() (stage.py asserts)
            cases[f"{name}/eval"] = evaluation(name)
        for offloader in offloaders:
            cases[f"{name}/{offloader}"] = offload(name, offloader)
    return run_cases(rank, cases)
