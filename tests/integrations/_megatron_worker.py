"""Worker side of the Megatron-core tests (runs in each spawned rank).

Megatron-core's schedules hard-code CUDA in a few places; :func:`install_cuda_shim` redirects
those to the CPU in this test process only (``torch.zeros(..., device="cuda")`` in
``schedules`` and ``torch.cuda.current_device()`` in ``p2p_communication``).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.integrations import _common
from tests.integrations._fakes import RecordingCache

SEQ = 4
MICRO_BATCH = 2
HIDDEN = 16
NUM_MICROBATCHES = 4
NUM_STEPS = 2

# name -> (pipeline size, chunks per rank)
SCHEDULES: dict[str, tuple[int, int]] = {
    "no_pipelining": (1, 1),
    "without_interleaving": (2, 1),
    "with_interleaving": (2, 2),
}


class _TorchWithoutCuda(types.ModuleType):
    """``torch`` as seen by megatron's schedules module, with ``device="cuda"`` mapped to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install_cuda_shim() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchWithoutCuda()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


class _Tag(torch.autograd.Function):
    """Identity that logs when backward reaches it: the ground truth of backward order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list, step: tuple) -> torch.Tensor:
        ctx.log, ctx.step = log, step
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.log.append((*ctx.step, "backward"))
        return grad, None, None


class Chunk(nn.Module):
    """One model chunk with the attributes megatron's schedules look for."""

    def __init__(self, stage: int, config: Any, is_first: bool, log: list) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.stage, self.is_first, self.log = stage, is_first, log
        gen = torch.Generator().manual_seed(2000 + stage)
        # Blocks in a ModuleList: the unit the cache offloads (all but the last).
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.Tanh())
            for a, b in ((HIDDEN, 2 * HIDDEN), (2 * HIDDEN, 2 * HIDDEN), (2 * HIDDEN, HIDDEN))
        )
        with torch.no_grad():
            for p in self.layers.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.pause = _common.SettleStores()
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: Any) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        h = x if self.is_first else self.input_tensor
        self.log.append((self.stage, microbatch, "forward"))
        for layer in self.layers:
            h = layer(h)
        h = self.pause(h)
        return _Tag.apply(h, self.log, (self.stage, microbatch))


def _loss(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = F.mse_loss(output, target)
    return loss, {"loss": loss.detach().clone()}


def _forward_step_func(data_iterator: Iterator[dict], model: Chunk) -> tuple[Any, Any]:
    batch = next(data_iterator)
    return model(batch["x"], batch["mb"]), functools.partial(_loss, batch["target"])


def run_schedule(
    name: str,
    rank: int,
    world: int,
    groups: dict[str, Any],
    make_cache: Any,
    patched: Any = contextlib.nullcontext,
    forward_only: bool = False,
) -> dict[str, Any]:
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp_size, chunks = SCHEDULES[name]
    vp = chunks if chunks > 1 else None
    config = TransformerConfig(
        num_layers=pp_size * chunks,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp,
        batch_p2p_comm=False,
    )
    pp_rank = rank if pp_size > 1 else 0
    executed: list[tuple[int, int, str]] = []
    models = [
        Chunk(c * pp_size + pp_rank, config, c == 0 and pp_rank == 0, executed)
        for c in range(chunks)
    ]
    caches = {m.stage: make_cache(m) for m in models}
    pgc = ProcessGroupCollection()
    pgc.tp = pgc.cp = pgc.dp_cp = groups["self"]
    pgc.embd = pgc.pos_embd = None
    pgc.pp = groups["world"] if pp_size > 1 else groups["self"]
    p2p = P2PCommunicator(pp_group=pgc.pp, config=config)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(11)
    out = _common.new_results()
    try:
        for _ in range(NUM_STEPS):
            batches = [
                {
                    "x": torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen),
                    "target": torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen),
                    "mb": i,
                }
                for i in range(NUM_MICROBATCHES)
            ]
            iterators = [iter(batches) for _ in models]
            for c in caches.values():
                if isinstance(c, RecordingCache):
                    c.calls.clear()
            starts = {s: len(getattr(c, "stage_log", ())) for s, c in caches.items()}
            executed.clear()
            opt.zero_grad()
            with patched():
                func = schedules.get_forward_backward_func(pp_size, vp)
                store = func(
                    forward_step_func=_forward_step_func,
                    data_iterator=iterators if vp else iterators[0],
                    model=models if vp else models[0],
                    num_microbatches=NUM_MICROBATCHES,
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=forward_only,
                    p2p_communicator=p2p,
                    pg_collection=pgc,
                )
            out["executed"].append(list(executed))
            out["losses"].append([d["loss"] for d in store])
            out["grads"].append(
                {
                    f"{m.stage}.{n}": None if p.grad is None else p.grad.clone()
                    for m in models
                    for n, p in m.named_parameters()
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


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    from tba.integrations import megatron as tm
    from tests.integrations._dist import run_cases

    install_cuda_shim()
    self_groups = [dist.new_group([r], backend="gloo") for r in range(world)]
    groups = {"self": self_groups[rank], "world": dist.group.WORLD}

    patched = functools.partial(_common.patched, tm)

    recording = _common.recording_cache

    baselines: dict[str, Any] = {}
    cases: dict[str, Any] = {}

    def baseline(name: str) -> Any:
        def case() -> None:
            baselines[name] = run_schedule(name, rank, world, groups, lambda m: None)

        return case

    def hints(name: str) -> Any:
        def case() -> None:
            got = run_schedule(name, rank, world, groups, recording, patched)
            _common.check_hints(got)
            _common.check_bit_exact(baselines[name], got)

        return case

    def offload(name: str, offloader: str) -> Any:
        def case() -> Any:
            with tempfile.TemporaryDirectory(prefix="tba-int-") as tmp, _common.settling():
                got = run_schedule(
                    name,
                    rank,
                    world,
                    groups,
                    lambda m: _common.real_cache(m, offloader, tmp),
                    patched,
                )
            _common.check_bit_exact(baselines[name], got)
            _common.check_real_cache(got)
            return got["stats"][-1]

        return case

    def forward_only(name: str) -> Any:
        def case() -> None:
            got = run_schedule(name, rank, world, groups, recording, patched, forward_only=True)
            _common.check_hints(got)
            assert all(a == "forward" for step in got["executed"] for _, _, a in step)

        return case

    for name in SCHEDULES:
        cases[f"{name}/baseline"] = baseline(name)
        cases[f"{name}/hints"] = hints(name)
        cases[f"{name}/forward_only"] = forward_only(name)
        for offloader in offloaders:
            cases[f"{name}/{offloader}"] = offload(name, offloader)
    return run_cases(rank, cases)
