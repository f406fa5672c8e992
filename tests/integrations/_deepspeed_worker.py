"""Worker side of the DeepSpeed tests (runs in each spawned rank, ``DS_ACCELERATOR=cpu``)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
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
MICRO_BATCH = 2
NUM_MICROBATCHES = 4
NUM_LAYERS = 6
NUM_STEPS = 2


def layer(index: int) -> nn.Module:
    gen = torch.Generator().manual_seed(3000 + index)
    module = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module


@contextlib.contextmanager
def record_execution(
    log: list[tuple[int, int, str]], trace: list[Any], stage: int
) -> Iterator[None]:
    """Record instructions as they run, below tba's wrappers (install before ``patch()``):
    every instruction's name goes to ``trace``; ForwardPass/BackwardPass also go to ``log``
    with their microbatch (forwards run in microbatch order; a backward's microbatch is the one
    last forwarded into its buffer)."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    table = PipelineEngine._INSTRUCTION_MAP
    originals = dict(table)
    buffers: dict[int, int] = {}
    count = [0]

    def recorder(cls: type, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(self: Any, **kwargs: Any) -> Any:
            trace.append(cls.__name__)
            if cls is schedule.ForwardPass:
                buffers[kwargs["buffer_id"]] = count[0]
                log.append((stage, count[0], "forward"))
                count[0] += 1
            elif cls is schedule.BackwardPass:
                log.append((stage, buffers[kwargs["buffer_id"]], "backward"))
            return fn(self, **kwargs)

        return run

    for cls, fn in originals.items():
        table[cls] = recorder(cls, fn)
    try:
        yield
    finally:
        table.update(originals)


def check_backward_hint_precedes_recv(trace: list[Any]) -> int:
    """Each backward that waits for gradients from the next stage was announced before that
    RecvGrad started, so its reload overlaps the communication."""
    num_checked = 0
    for i, item in enumerate(trace):
        if item != "BackwardPass":
            continue
        recv = max((j for j in range(i) if trace[j] == "RecvGrad"), default=None)
        hint = max((j for j in range(i) if isinstance(trace[j], tuple)), default=None)
        assert hint is not None and trace[hint][3] == "backward", (i, trace[: i + 1])
        if recv is not None and recv > max(
            (j for j in range(i) if trace[j] in ("ForwardPass", "BackwardPass")), default=-1
        ):
            assert hint < recv, f"backward announced after its RecvGrad: {trace[: i + 1]}"
            num_checked += 1
    return num_checked


def run_engine(
    rank: int, world: int, make_cache: Any, patched: Any, evaluate: bool = False
) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    per_stage = NUM_LAYERS // world
    module = PipelineModule(
        # Per stage: NUM_LAYERS // world layers, then a SettleStores.
        layers=[
            m
            for s in range(world)
            for m in [*(layer(s * per_stage + i) for i in range(per_stage)), _common.SettleStores()]
        ],
        num_stages=world,
        loss_fn=lambda out, target: F.mse_loss(out, target),
        partition_method="uniform",
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": NUM_MICROBATCHES,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    stage = engine.stage_id
    cache = make_cache(engine.module)
    grads: dict[str, torch.Tensor] = {}
    hooks = [
        p.register_post_accumulate_grad_hook(
            functools.partial(lambda name, p: grads.__setitem__(name, p.grad.clone()), n)
        )
        for n, p in engine.module.named_parameters()
    ]
    gen = torch.Generator().manual_seed(5)
    out = _common.new_results()
    try:
        for _ in range(NUM_STEPS):
            data = [
                (
                    torch.randn(MICRO_BATCH, D, generator=gen),
                    torch.randn(MICRO_BATCH, D, generator=gen),
                )
                for _ in range(NUM_MICROBATCHES)
            ]
            if isinstance(cache, RecordingCache):
                cache.calls.clear()
            start = len(getattr(cache, "stage_log", ()))
            grads.clear()
            executed: list[tuple[int, int, str]] = []
            trace: list[Any] = []
            if isinstance(cache, RecordingCache):
                cache.trace = trace
            with record_execution(executed, trace, stage), patched():
                if evaluate:  # InferenceSchedule, forwards only
                    engine.eval_batch(iter(data), bcast_loss=False)
                else:
                    engine.train_batch(iter(data))
            out["executed"].append(executed)
            out.setdefault("traces", []).append(trace)
            out["losses"].append([t.clone() for t in engine.fwd_outputs])
            out["grads"].append(dict(grads))
            out["logs"].append({stage: list(getattr(cache, "stage_log", ()))[start:]})
            if isinstance(cache, RecordingCache):
                out["lookahead"].append({stage: cache.lookahead_log()})
            out["stats"].append({stage: _common.stats_dict(cache)})
    finally:
        for h in hooks:
            h.remove()
        if cache is not None:
            cache.close()
    dist.barrier()
    return out


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    import deepspeed

    from tba.integrations import deepspeed as tds
    from tests.integrations._dist import run_cases

    # The CPU accelerator JIT-builds a shared-memory allreduce kernel (~110 s on 2 cores) that
    # these pipeline tests never use (gloo does the communication): skip building it.
    # (deepspeed.comm re-exports the name ``torch``: reach the submodule through sys.modules.)
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing process group

    patched = functools.partial(_common.patched, tds)

    recording = _common.recording_cache

    results: dict[str, Any] = {}

    def baseline() -> None:
        results["baseline"] = run_engine(rank, world, lambda m: None, contextlib.nullcontext)

    def hints() -> None:
        got = run_engine(rank, world, recording, patched)
        _common.check_hints(got)
        _common.check_bit_exact(results["baseline"], got)
        num_checked = sum(check_backward_hint_precedes_recv(t) for t in got["traces"])
        if rank < world - 1:  # stages with a next stage receive gradients before backward
            assert num_checked == NUM_STEPS * NUM_MICROBATCHES, num_checked

    def offload(offloader: str) -> Any:
        def case() -> Any:
            with tempfile.TemporaryDirectory(prefix="tba-int-") as tmp, _common.settling():
                got = run_engine(
                    rank, world, lambda m: _common.real_cache(m, offloader, tmp), patched
                )
            _common.check_bit_exact(results["baseline"], got)
            _common.check_real_cache(got)
            return got["stats"][-1]

        return case

    def evaluation() -> None:
        got = run_engine(rank, world, recording, patched, evaluate=True)
        _common.check_hints(got)
        assert all(a == "forward" for step in got["executed"] for _, _, a in step)

    cases: dict[str, Any] = {
        "TrainSchedule/baseline": baseline,
        "TrainSchedule/hints": hints,
        "InferenceSchedule/hints": evaluation,
    }
    for offloader in offloaders:
        cases[f"TrainSchedule/{offloader}"] = offload(offloader)
    return run_cases(rank, cases)
