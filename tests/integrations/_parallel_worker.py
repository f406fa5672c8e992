"""Worker side of the data-parallel and tensor-parallel tests (no pipeline hints involved)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.integrations import _common

D = 16
BATCH = 8
NUM_BLOCKS = 3
NUM_STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 4 * D)
        self.w2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4000)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.pause = _common.SettleStores()
        self.head = nn.Linear(D, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.pause(x))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach().clone()


def train(rank: int, style: str, make_cache: Any) -> dict[str, Any]:
    """Two steps of ``style`` ("ddp" or "tp") training; losses and (local) gradients."""
    model = Model()
    if style == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
        inner = model
        data_seed = 100 + rank  # each rank its own data, gradients all-reduced
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        wrapped = inner = model
        data_seed = 100  # TP ranks see the same batch
    cache = make_cache(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(data_seed)
    out: dict[str, Any] = {"losses": [], "grads": [], "stats": []}
    try:
        for _ in range(NUM_STEPS):
            x = torch.randn(BATCH, D, generator=gen)
            target = torch.randn(BATCH, D, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(wrapped(x), target)
            loss.backward()
            out["losses"].append([_local(loss)])
            out["grads"].append({n: _local(p.grad) for n, p in model.named_parameters()})
            out["stats"].append({0: _common.stats_dict(cache)})
            opt.step()
    finally:
        if cache is not None:
            cache.close()
    dist.barrier()
    return out


def worker(rank: int, world: int, offloaders: list[str]) -> dict[str, tuple[bool, Any]]:
    from tests.integrations._dist import run_cases

    baselines: dict[str, Any] = {}

    def baseline(style: str) -> Any:
        def case() -> None:
            baselines[style] = train(rank, style, lambda m: None)

        return case

    def offload(style: str, offloader: str) -> Any:
        def case() -> Any:
            with tempfile.TemporaryDirectory(prefix="tba-int-") as tmp, _common.settling():
                got = train(rank, style, lambda m: _common.real_cache(m, offloader, tmp))
            _common.check_bit_exact(baselines[style], got)
            stats = got["stats"][-1][0]
            assert stats["offloaded_bytes"] > 0 and stats["reloaded_bytes"] > 0, f"nothing was moved: {stats}"
            return stats

        return case

    cases: dict[str, Any] = {}
    for style in ("ddp", "tp"):
        cases[f"{style}/baseline"] = baseline(style)
        for offloader in offloaders:
            cases[f"{style}/{offloader}"] = offload(style, offloader)
    return run_cases(rank, cases)
